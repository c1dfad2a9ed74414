"""The suite's own mutation check: does the daily subset catch a planted bug?

Each `Mutant` below is a small, plausible bug (a swapped argument, an off-by-one in a mask or a
loop bound, a missing reduction or factor, a wrong axis or layout) in the engine, attention,
packing, MoE, the rollout engine and the RL losses. The script plants one at a time in the
checkout (the exact text must occur once in its file), runs the daily tests (`-m "not slow"`) of
the files that should catch it, restores the file (also on Ctrl-C or an error), and prints one
row per mutant: the daily test that caught it (the first to fail), or MISSED. It exits 1 if any
mutant was missed. First, as a control, the same tests run on the unmutated tree and must pass
(so a failure is the bug's, not a broken test's or the compile budget's).

    python tests/support/mutation_check.py                 # every mutant, about 5 minutes
    python tests/support/mutation_check.py --only grpo_clip_swapped kl_sign

It edits files of the checkout in place while it runs: run it on a tree no one else is editing.
Its table is in docs/testing.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    area: str
    path: str               # the file the bug is planted in
    old: str                # its exact text (once in the file)
    new: str                # the bug
    tests: tuple[str, ...]  # the test files whose daily tests should catch it
    what: str               # the bug in words


MUTANTS = (
    Mutant("packed_positions_from_one", "packing", "zeroxla/engine/bin_packing.py",
           'out["positions"][row, at] = np.arange(n)',
           'out["positions"][row, at] = np.arange(1, n + 1)',
           ("tests/zeroxla/app/test_packing.py",),
           "packing: each packed sequence's positions start at 1 instead of 0"),
    Mutant("blockwise_last_kv_block", "attention", "models/blockwise_attention.py",
           "hi = jnp.minimum(num_kv_blocks, (first + bq - 1) // bk + 1)",
           "hi = jnp.minimum(num_kv_blocks, (first + bq - 1) // bk)",
           ("tests/models/test_blockwise_attention.py",),
           "blockwise attention: a query block's loop stops one key block early"),
    Mutant("blockwise_segments_compare", "attention", "models/blockwise_attention.py",
           "visible = (visible & (seg_q[:, :, None] == seg_k[:, None, :])",
           "visible = (visible & (seg_q[:, :, None] >= seg_k[:, None, :])",
           ("tests/models/test_blockwise_attention.py",),
           "packed attention: a sequence attends to the earlier sequences of its row"),
    Mutant("blockwise_backward_delta", "attention", "models/blockwise_attention.py",
           "ds = p * (dp - delta_blk[..., None])",
           "ds = p * dp",
           ("tests/models/test_blockwise_attention.py",),
           "blockwise attention's backward: the softmax Jacobian's row term missing"),
    Mutant("ring_merge_weights_swapped", "attention", "models/online_softmax.py",
           "return out * weight(lse) + other * weight(other_lse), total",
           "return out * weight(other_lse) + other * weight(lse), total",
           ("tests/models/test_ring_attention.py",),
           "ring attention's merge: two partial softmaxes merged with each other's weights"),
    Mutant("deltanet_ulysses_conv_heads", "sequence parallel", "models/gated_deltanet.py",
           "lax.dynamic_slice_in_dim(w, r * (w.shape[1] // p)",
           "lax.dynamic_slice_in_dim(w, 0 * (w.shape[1] // p)",
           ("tests/models/test_gated_delta.py",),
           "Gated DeltaNet under Ulysses: every device convolves with the first heads' filters"),
    Mutant("loss_count_per_device", "engine", "zeroxla/engine/step.py",
           "        count = lax.psum(count, data)\n        count = jnp.where(count > 0",
           "        count = jnp.where(count > 0",
           ("tests/zeroxla/engine/test_loss_mask.py",),
           "the step: a masked loss divided by this device's token count, not the global one"),
    Mutant("grpo_clip_swapped", "rl losses", "zeroxla/rlhf/grpo/losses.py",
           "clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)",
           "clipped = jnp.clip(ratio, 1.0 - epsilon_high, 1.0 + epsilon)",
           ("tests/zeroxla/rlhf/test_grpo_losses.py",),
           "GRPO: the lower and upper clip ranges swapped (DAPO's clip-higher lost)"),
    Mutant("kl_sign", "rl losses", "zeroxla/rlhf/grpo/losses.py",
           "delta = ref_logprobs - logprobs",
           "delta = logprobs - ref_logprobs",
           ("tests/zeroxla/rlhf/test_grpo_losses.py",),
           "GRPO: the k3 KL estimator of KL(reference || policy) instead of (policy || reference)"),
    Mutant("grpo_per_answer_mean", "rl losses", "zeroxla/rlhf/grpo/losses.py",
           "per_answer = jnp.sum(masked, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)",
           "per_answer = jnp.sum(masked, axis=1) / mask.shape[1]",
           ("tests/zeroxla/rlhf/test_grpo_losses.py",),
           "GRPO's 'grpo' loss: each answer divided by the padded length, not its own"),
    Mutant("group_std_biased", "rl losses", "zeroxla/rlhf/grpo/group_advantages.py",
           "centred = centred / (grouped.std(axis=1, ddof=1, keepdims=True) + STD_EPS)",
           "centred = centred / (grouped.std(axis=1, ddof=0, keepdims=True) + STD_EPS)",
           ("tests/zeroxla/rlhf/test_group_advantages.py",),
           "GRPO advantages: the group's biased std instead of TRL's unbiased one"),
    Mutant("gae_missing_lambda", "rl losses", "zeroxla/rlhf/ppo/advantages.py",
           "gae = delta + gamma * lam * lastgaelam",
           "gae = delta + gamma * lastgaelam",
           ("tests/zeroxla/rlhf/test_ppo.py",),
           "PPO: GAE without its lambda"),
    Mutant("reward_on_last_token", "rl losses", "zeroxla/rlhf/ppo/advantages.py",
           "last = jnp.sum(mask, axis=1).astype(jnp.int32) - 1",
           "last = jnp.sum(mask, axis=1).astype(jnp.int32)",
           ("tests/zeroxla/rlhf/test_ppo.py",),
           "PPO: the reward score placed one past the answer's last real token"),
    Mutant("critic_clip_around_new", "rl losses", "zeroxla/rlhf/ppo/losses.py",
           "clipped = jnp.clip(values, old_values - cliprange_value, old_values + cliprange_value)",
           "clipped = jnp.clip(values, values - cliprange_value, values + cliprange_value)",
           ("tests/zeroxla/rlhf/test_ppo.py",),
           "PPO: the value clip centred on the new values (no clipping at all)"),
    Mutant("moe_mask_tiled", "moe", "models/moe.py",
           "jnp.repeat(m, self.top_k))",
           "jnp.tile(m, self.top_k))",
           ("tests/models/test_moe_hf.py",),
           "MoE: the per-assignment token mask laid out by tile instead of repeat"),
    Mutant("router_counts_padding", "moe", "models/moe.py",
           "m = jnp.ones((b * t,), probs.dtype) if mask is None else mask.reshape(b * t)",
           "m = jnp.ones((b * t,), probs.dtype)",
           ("tests/models/test_moe_hf.py",),
           "MoE: the router statistics count padding tokens"),
    Mutant("paged_last_key_block", "continuous batching", "models/paged_attention.py",
           "hi = jnp.max(pos) // bk + 1",
           "hi = jnp.maximum(1, (jnp.max(pos) - 1) // bk + 1)",
           ("tests/models/test_paged_attention.py",),
           "paged attention: a token at a key block's start does not read that block"),
    Mutant("token_budget_forgets_sequence", "rl losses", "zeroxla/rlhf/packed_rollout.py",
           "return token_budget * layout.sequence.size // chunks * chunks",
           "return token_budget // chunks * chunks",
           ("tests/zeroxla/rlhf/test_packed_rollout.py",),
           "RL token budget under sequence parallelism: a row of one device's budget, not P's"),
    Mutant("one_knob_set_for_every_prompt", "continuous batching",
           "zeroxla/inference/continuous.py",
           "keys=key_data, max_new=new, row=entries[sampling],",
           "keys=key_data, max_new=new, row=entries[samplings[0]],",
           ("tests/zeroxla/inference/test_continuous.py",),
           "continuous batching: every prompt drawn with the first prompt's sampling knobs"),
    Mutant("planner_offload_layer", "planner", "zeroxla/analysis/planner.py",
           "host - host_residual_layer_bytes(traced) if derived else 0)",
           "host if derived else 0)",
           ("tests/zeroxla/analysis/test_planner.py",),
           "zeroxla plan under remat offload: the layer back on the device for its backward "
           "not counted"),
    Mutant("page_freed_while_shared", "continuous batching", "zeroxla/inference/pages.py",
           "if self._refs[page] == 0:",
           "if self._refs[page] <= 1:",
           ("tests/zeroxla/inference/test_pages.py",),
           "page pool: a page shared by a group's answers returned to the free list while held"),
)


def plant(mutant: Mutant) -> str:
    """Writes the bug into its file; returns the file's original text."""
    path = ROOT / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(f"{mutant.name}: its text occurs {count} times in {mutant.path} "
                         f"(expected once): {mutant.old!r}")
    path.write_text(text.replace(mutant.old, mutant.new))
    return text


def run_tests(tests: tuple[str, ...]) -> tuple[int, str]:
    """(pytest's exit status, the first failing test or else its last line) for the daily
    tests of `tests`, stopping at the first failure."""
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-rf", "-m", "not slow",
               "-p", "no:cacheprovider", "--no-header", "-o", "addopts=", *tests]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    failed = [line.split()[1] for line in lines if line.startswith("FAILED ")]
    return result.returncode, (failed[0] if failed else lines[-1] if lines
                               else result.stderr[-200:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help=f"these mutants only (of: {', '.join(m.name for m in MUTANTS)})")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}")
    for tests in dict.fromkeys(m.tests for m in chosen):     # the control: all pass unmutated
        status, last = run_tests(tests)
        if status != 0:
            raise SystemExit(f"the daily tests of {', '.join(tests)} do not pass without a "
                             f"planted bug (exit {status}: {last}); fix them first")
    print("| mutant | area | the bug | caught by | s |\n|---|---|---|---|---|")
    missed = 0
    for mutant in chosen:
        start = time.perf_counter()
        original = plant(mutant)
        try:
            status, last = run_tests(mutant.tests)
        finally:
            (ROOT / mutant.path).write_text(original)
        caught = status == 1                                 # tests ran, and one failed
        missed += not caught
        verdict = f"`{last.split('/')[-1]}`" if caught else f"MISSED (exit {status}: {last})"
        print(f"| {mutant.name} | {mutant.area} | {mutant.what} | {verdict} | "
              f"{time.perf_counter() - start:.0f} |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
