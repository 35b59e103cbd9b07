"""What a codec's encode and decode cost compiled, against their memory traffic and the trace's price.

The tracer prices a codec by its Inductor-compiled encode and decode, timed once
per (codec, dtype, row length) on 4 MB probes (``passes/codec_timing.py``); it
used to price them by memory traffic alone, encode reading the tensor and
writing the payload and decode the reverse, at this machine's copy bandwidth
(``passes/profile.py``, ``_codec_traffic_seconds``, still the price of units
under 128 KB). Traffic is right for int8 in fp32 within 1.4-1.7x but makes
int4, whose payload is half int8's, the cheaper codec, which it is not. This
study compiles each codec's encode and decode with Inductor, as the step runs
them, times them on activations of ``small``'s shapes (B=2, T=2048: hidden 256
and MLP width 688; half the bytes in bf16) and prints the three figures per
unit. Run from the repository root, on an otherwise idle machine (about a minute):

    python3 bench/codec_cost.py [--threads 1] [--dtype float32]

The compiled kernels here stand alone: in the step Inductor may fuse encode
into the op that makes the value and decode into its first use, which saves a
read or write of the full-size tensor each, so these times and the trace's
price are an upper bound on what the step adds; the traffic price is the lower one.
"""

from __future__ import annotations

import argparse

import torch

from hilore_compiler.codecs import get_codec
from hilore_compiler.passes.codec_timing import encode_decode_seconds
from hilore_compiler.passes.profile import ProfileConfig, _codec_measured_seconds, _codec_traffic_seconds, copy_bandwidth

#: (label, shape) of the activations ``small`` saves at B=2, T=2048.
SHAPES = (("hidden", (2, 2048, 256)), ("MLP", (2, 2048, 688)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--codecs", default="int8,int4")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(torch.device("cpu"))  # measured once; the price below reuses it
    timing = ProfileConfig()  # only the priced figures read it (batch, seq_len)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), {args.threads} thread(s), {args.dtype}")
    print("codec  unit    MB     encode ms  decode ms  compiled ms  traffic ms  compiled / traffic  priced ms")
    for name in args.codecs.split(","):
        codec = get_codec(name)
        if not codec.supports(dtype):
            print(f"{name:<6} does not take {args.dtype}")
            continue
        for label, shape in SHAPES:
            # Distinct inputs per call, larger together than the last-level
            # cache, so the codec streams from memory as a saved activation does.
            xs = [torch.randn(shape, dtype=dtype) for _ in range(8)]
            enc, dec = encode_decode_seconds(codec, xs, repeats=args.repeats)
            raw = xs[0].numel() * xs[0].element_size()
            payload = codec.encoded_nbytes_expr(shape, dtype)
            # The tracer's own prices of this unit (passes/profile.py), not copies of their formulas.
            traffic = _codec_traffic_seconds(xs[:1], payload, timing)
            priced = _codec_measured_seconds(codec, xs[:1], payload, timing)
            print(f"{name:<6} {label:<7} {raw / 1e6:5.1f}  {enc * 1e3:9.2f}  {dec * 1e3:9.2f}  {(enc + dec) * 1e3:11.2f}  "
                  f"{traffic * 1e3:10.2f}  {(enc + dec) / traffic:18.1f}  {priced * 1e3:9.2f}")


if __name__ == "__main__":
    main()
