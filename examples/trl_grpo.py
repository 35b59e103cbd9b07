"""Train a tiny random Qwen2 with TRL's GRPOTrainer, its actor update planned by hilore.

Everything is made in code (model config, character tokenizer, a verifiable
task: "start the answer with the largest digit of the prompt"), so nothing is
downloaded and a run takes a few minutes on a CPU:

    python examples/trl_grpo.py                 # HiLoReGRPOTrainer
    python examples/trl_grpo.py --trainer trl   # TRL alone, for the step time

Per optimizer step it prints the reward, TRL's step time (generation
included), the samples per exposure bucket and the samples whose microbatch
skipped forward and backward; at the end the median step time after the
first (compiling) step. To compare step times on a shared CPU, run both with
``OMP_NUM_THREADS=1``: Inductor's OpenMP kernels spin-wait when the cores are
oversubscribed, which can make a compiled step 50x slower.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from hilore_compiler.integrations.toy import (
    char_tokenizer,
    digit_dataset,
    largest_digit_reward,
    tiny_qwen2,
)


class PrintSteps(TrainerCallback):
    """One line per logged step: reward, step time, bucket histogram, skipped samples."""

    def __init__(self) -> None:
        self.step_times: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "step_time" not in logs:
            return
        self.step_times.append(logs["step_time"])
        buckets = {k.removeprefix("hilore/bucket_"): int(v) for k, v in logs.items()
                   if k.startswith("hilore/bucket_")}
        line = (f"step {state.global_step:3d}  reward {logs.get('reward', 0):.3f}  "
                f"step_time {logs['step_time']:.2f}s")
        if buckets:
            line += f"  buckets {buckets}  skipped {int(logs.get('hilore/skipped_samples', 0))}"
        print(line, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", choices=("hilore", "trl"), default="hilore")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--completion-length", type=int, default=8)
    p.add_argument("--codecs", default="bf16,int8", help="comma-separated; empty: store/recompute only")
    p.add_argument("--buckets", type=int, default=3, help="nonzero exposure buckets")
    p.add_argument("--output-dir", default="trl-grpo-example")
    return p.parse_args()


def main() -> None:
    cli = parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames
    tok = char_tokenizer()
    model = tiny_qwen2(tok, hidden=cli.hidden, layers=cli.layers)
    args = GRPOConfig(
        output_dir=cli.output_dir, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        disable_tqdm=True, seed=0, logging_steps=1, max_steps=cli.steps,
        per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=8,
        max_completion_length=cli.completion_length, temperature=1.0, learning_rate=3e-3,
        loss_type="dapo",
        # TRL turns checkpointing on by default; the subclass turns it off (and
        # says why), so the TRL baseline runs without it too, for a fair timing.
        gradient_checkpointing=cli.trainer == "hilore",
    )
    common = dict(model=model, reward_funcs=largest_digit_reward, args=args,
                  train_dataset=digit_dataset(4096), processing_class=tok)
    if cli.trainer == "trl":
        trainer = GRPOTrainer(**common)
    else:
        from hilore_compiler.integrations.trl import HiLoReGRPOTrainer

        codecs = [c for c in cli.codecs.split(",") if c]
        trainer = HiLoReGRPOTrainer(**common, hilore_options={"codecs": codecs, "buckets": cli.buckets})
    printer = PrintSteps()
    trainer.add_callback(printer)
    trainer.train()
    later = printer.step_times[1:]
    if later:
        print(f"{cli.trainer}: median step time after the first step {statistics.median(later):.3f}s "
              f"over {len(later)} steps (first step {printer.step_times[0]:.1f}s)")
    if cli.trainer == "hilore":
        print(f"compiled graphs: {len(trainer.hilore_backend.graphs)}")


if __name__ == "__main__":
    main()
