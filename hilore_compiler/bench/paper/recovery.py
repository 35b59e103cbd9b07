"""The paper's recovery unit: one decoder layer's saved tensors in one step, kept (H), kept with
one MLP tensor in fp8 (L), or dropped and replayed in backward (R).

HiLoRe's reference runtime (``ChnIRuI/HiLoRe``, ``hilore/recovery.py``) in our own code. Each
tensor a layer's forward saves for backward goes through ``saved_tensors_hooks``
(``LayerBundle.pack``) and is then addressed by its index. Before the forward each layer gets a
*capture*, what ``pack`` keeps: R nothing, H every tensor, L every tensor with the selected one
in fp8. After the loss, once the GRPO coefficients are known, ``select`` fixes the layer's
*action*, which can only drop what the capture kept (H -> H, L or R; L -> L or R). R replays
the layer from its detached inputs on the first unpack in backward, under the forward's RNG and
autocast state, checks every re-saved tensor's metadata against the forward's and stops the
replay after the last one, as non-reentrant ``torch.utils.checkpoint`` with early stop does.

The L tensor (the reference's rule, ``LayerBundle._eligible``): the first tensor saved inside
the layer's ``mlp`` that has a ``grad_fn`` and the compute dtype (the layer input's), is
contiguous, holds at least ``threshold_bytes`` (elements x element size), and whose storage
neither a layer input nor an earlier saved tensor holds; one per layer at most. A later saved
tensor on its storage, or an fp8 value that is not finite once cast back, takes L away from
the layer. One backward per forward: a retained or second backward raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

#: The paper's actions, in the allocator's column order (its tie-break order too).
ACTIONS = ("R", "H", "L")

#: What each capture leaves ``select`` (L only where the layer has an L tensor).
AFTER_CAPTURE = {"R": ("R",), "H": ("R", "H", "L"), "L": ("R", "L")}

#: The cast L keeps its tensor in, unscaled as the reference's. e4m3fn has no inf; what an
#: out-of-range value becomes depends on the kernel (torch 2.13's CPU cast saturates to +-448,
#: inf included), a NaN stays NaN: hence the finiteness check after the cast back.
FP8 = torch.float8_e4m3fn

#: Metadata ``pack`` records and a replay must reproduce: shape, stride, dtype, device.
Record = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


class _ReplayDone(Exception):
    """Raised by the replay's pack hook once every saved tensor is back: the rest of the layer is not run."""


def _record(t: torch.Tensor) -> Record:
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.device


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    """``t``'s storage's identity: held, the weak reference keeps its address from being reused."""
    return StorageWeakRef(t.untyped_storage())


def _detached(value: Any) -> Any:
    return value.detach().requires_grad_(value.requires_grad) if isinstance(value, torch.Tensor) else value


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


class LayerBundle:
    """One decoder layer's saved tensors in one step: what its capture kept, its action, its replay."""

    def __init__(self, forward: Callable[..., Any], args: tuple, kwargs: dict, *, capture: str,
                 threshold_bytes: int, parameters: frozenset, measure_error: bool = False) -> None:
        if capture not in AFTER_CAPTURE:
            raise ValueError(f"capture must be one of {', '.join(AFTER_CAPTURE)}, got {capture!r}")
        hidden = args[0] if args else kwargs["hidden_states"]  # (B, T, C)
        self.forward_fn, self.capture, self.threshold_bytes = forward, capture, threshold_bytes
        self.compute_dtype, self.device = hidden.dtype, hidden.device
        # Replay runs on detached inputs: its graph is thrown away, the forward's is the one backward runs.
        self.args, self.kwargs = tree_map(_detached, args), tree_map(_detached, kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.input_keys = {storage_key(t) for t in inputs}
        self.input_versions = [(t, t._version) for t in inputs]
        self.rng = _rng_state(hidden.device)
        self.autocast = (torch.is_autocast_enabled(hidden.device.type), torch.get_autocast_dtype(hidden.device.type),
                         torch.is_autocast_cache_enabled())
        self.parameters, self.measure_error = parameters, measure_error
        self.records: list[Record] = []
        self.in_mlp: list[bool] = []  # per saved tensor: packed inside the layer's mlp
        self.keys: list[StorageWeakRef] = []
        self.values: list[torch.Tensor | None] = []
        self.versions: list[int | None] = []
        self.selected: int | None = None
        self.mlp_depth, self.invalid_alias, self.nonfinite = 0, False, False
        self.action: str | None = None
        self.replays, self.backward_started = 0, False
        #: Bytes of the distinct storages saved, other than the layer's parameters and inputs.
        self.activation_bytes = 0
        # The reference's reconstruction error: ||fp8(x) - x|| over the norm of every saved tensor.
        self.error_sq = self.state_sq = 0.0

    # -- forward ---------------------------------------------------------------------------

    def run(self, args: tuple, kwargs: dict) -> Any:
        """The layer's forward with this bundle's hooks on every tensor it saves."""
        with saved_tensors_hooks(self.pack, self.unpack):
            return self.forward_fn(*args, **kwargs)

    def _eligible(self, t: torch.Tensor, key: StorageWeakRef) -> bool:
        return (self.mlp_depth > 0 and self.selected is None and t.grad_fn is not None
                and t.dtype == self.compute_dtype and t.is_contiguous()
                and t.numel() * t.element_size() >= self.threshold_bytes
                and key not in self.keys and key not in self.input_keys)

    def pack(self, t: torch.Tensor) -> int:
        index = len(self.records)
        key = storage_key(t)
        if self.selected is not None and key == self.keys[self.selected]:
            self.invalid_alias = True  # the fp8 copy would not be what this one reads
        eligible = self._eligible(t, key)
        if key not in self.keys and key not in self.parameters and key not in self.input_keys:
            self.activation_bytes += t.untyped_storage().nbytes()
        self.records.append(_record(t))
        self.in_mlp.append(self.mlp_depth > 0)
        self.keys.append(key)
        if self.measure_error:
            self.state_sq += t.detach().float().square().sum().item()
        if eligible:
            self.selected = index
        value = None if self.capture == "R" else t.detach()
        if eligible and self.capture == "L":
            value = self._compress(value)
        self.values.append(value)
        self.versions.append(None if value is None else value._version)
        return index

    def _compress(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in fp8; marks L unavailable when the round trip is not finite."""
        low = t.to(FP8)
        back = low.to(self.compute_dtype)
        self.nonfinite = not bool(torch.isfinite(back).all())
        if self.measure_error:
            self.error_sq = (back.float() - t.float()).square().sum().item()
        return low

    # -- after the forward -----------------------------------------------------------------

    @property
    def available(self) -> frozenset[str]:
        """The actions ``select`` may take, given the capture and the L tensor."""
        actions = set(AFTER_CAPTURE[self.capture])
        if self.selected is None or self.invalid_alias or self.nonfinite:
            actions.discard("L")
        return frozenset(actions)

    def select(self, action: str) -> str:
        """Fix this step's action, once, before backward; returns it (R where L's fp8 is not finite)."""
        if self.backward_started or self.action is not None:
            raise RuntimeError("a layer's recovery is selected once, before backward")
        if action not in self.available:
            raise ValueError(f"action {action!r} is not available after capture {self.capture!r} "
                             f"({sorted(self.available)}): what the capture dropped cannot come back")
        self.action = action
        if action == "R":
            self.values = [None] * len(self.records)
        elif action == "L" and self.capture == "H":
            self.values[self.selected] = self._compress(self.values[self.selected])
            self.versions[self.selected] = self.values[self.selected]._version
            if self.nonfinite:
                self.action, self.values = "R", [None] * len(self.records)
        return self.action

    @property
    def reconstruction_error(self) -> float:
        """The L tensor's fp8 error over the norm of every tensor the layer saved (``measure_error``)."""
        return self.error_sq ** 0.5 / (self.state_sq ** 0.5 + 1e-8)

    def kept_bytes(self) -> int:
        """Bytes of the distinct storages this bundle holds for backward now."""
        kept = {storage_key(v): v.untyped_storage().nbytes() for v in self.values if v is not None}
        return sum(b for k, b in kept.items() if k not in self.parameters and k not in self.input_keys)

    # -- backward --------------------------------------------------------------------------

    def unpack(self, index: int) -> torch.Tensor:
        if self.action is None:
            raise RuntimeError("backward reached a layer whose recovery was not selected after the forward")
        self.backward_started = True
        self._check_inputs("backward")
        value = self.values[index]
        if self.action != "R" and value is not None and value._version != self.versions[index]:
            raise RuntimeError("a tensor kept for backward was modified in place")
        if value is None:
            if self.action != "R" or self.replays:
                raise RuntimeError("saved tensors are used by one backward only")
            self._replay()
            value = self.values[index]
        self.values[index] = None  # each saved tensor is read once: free it as soon as it is
        if self.action == "L" and index == self.selected:
            value = value.to(self.compute_dtype)
        return value

    def _check_inputs(self, when: str) -> None:
        if any(t._version != v for t, v in self.input_versions):
            raise RuntimeError(f"a layer input was modified in place before {when}")

    def _replay(self) -> None:
        """Run the layer again from its inputs and collect what it saves, in order (action R)."""
        self._check_inputs("the replay")
        index = 0

        def collect(t: torch.Tensor) -> None:
            nonlocal index
            if index >= len(self.records) or _record(t) != self.records[index]:
                raise RuntimeError("the replay saved other tensors than the forward")
            self.values[index] = t.detach()
            index += 1
            if index == len(self.records):
                raise _ReplayDone

        cpu_rng, device_rng = self.rng
        enabled, dtype, cache = self.autocast
        devices = [self.device] if device_rng is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                torch.autocast(self.device.type, enabled=enabled, dtype=dtype, cache_enabled=cache), \
                saved_tensors_hooks(collect, lambda x: x):
            torch.set_rng_state(cpu_rng)
            if device_rng is not None:
                torch.cuda.set_rng_state(device_rng, self.device)
            try:
                self.forward_fn(*self.args, **self.kwargs)
            except _ReplayDone:
                pass
        if index != len(self.records):
            raise RuntimeError("the replay saved fewer tensors than the forward")
        self.replays += 1
