"""``ds-diloco bench quality``: the report (text table, plot) of a :class:`QualityBench`."""

from __future__ import annotations

import statistics
from pathlib import Path

from ds_diloco.bench import shown
from ds_diloco.bench.quality import (
    BYTES_GOAL,
    FIXED,
    LOSS_GOAL,
    MAIN,
    QualityBench,
    Result,
)
from ds_diloco.compress import CODECS


def _kb(x: float) -> str:
    return f"{x / 1e3:.2f} kB" if x >= 1e3 else f"{x:.1f} B"


def _counts(r: Result) -> str:
    """Contributions merged / dropped, the share of island steps dropped, per island."""
    if not r.islands:
        return ""
    per = " ".join(f"{i['merged']}/{i['dropped']}" for i in r.islands.values())
    stale = ",".join(f"{k}:{v}" for k, v in r.by_staleness.items()) or "-"
    return (
        f"{r.sent:5d} {r.merged:6d} {r.dropped:7d} {r.steps_dropped_share:6.0%} "
        f"{r.steps_overwritten_share:5.0%}  {per:24s} "
        f"{stale:>10s}  " + ",".join(f"{k}:{v}" for k, v in r.by_quorum.items())
    )


def format_report(b: QualityBench, argv: str = "ds-diloco bench quality") -> str:
    s, res = b.setup, b.results
    cpu = "CPU" if not s.gpus else f"{s.gpus} GPU(s)"
    seeds = len(res["zero3"])
    wait = (
        f"wait {s.wait_expected_steps:g} steps for expected islands, "
        if s.wait_expected_steps
        else ""
    )
    keep = ", local steps since each upload kept" if s.keep_local_steps else ""
    lines = [
        f"{argv}",
        f"  model {Path(s.model_config).name} ({b.evaluator_params:,} parameters), "
        f"{Path(s.deepspeed_config).name}, on {cpu}; text {s.corpus}, seq_len {s.seq_len}",
        f"  every method: {s.tokens:,} tokens = {s.steps} steps x {s.ranks} ranks x micro_batch "
        f"{s.micro_batch} x {s.seq_len}; inner AdamW lr {s.lr:g}, warm-up {s.warmup_steps}",
        f"  baseline: one ZeRO-3 job of {s.ranks} ranks; DiLoCo: M = {s.islands} islands x "
        f"{s.ranks_per_island} rank(s) (every process one rank: this machine has few cores)",
        f"  outer: P = {s.num_fragments}, H = {s.sync_every}, tau = {s.tau}{keep}, "
        "token weights, "
        f"RDA (embeddings plain), stale dropped; sync: K = {s.islands}, no grace, "
        f"{s.outer('sync')}; decoupled: K = 1, grace gamma {s.grace_gamma:g}, {wait}"
        f"{s.outer('decoupled')}; pseudo-gradients {s.compression} (block {s.block})",
        f"  held-out: {s.eval_blocks} blocks ({s.eval_blocks * s.seq_len:,} tokens) never "
        f"trained on; outer settings tuned (--tune) on the next {s.eval_blocks} with other "
        "seeds, not these",
        f"  seeds: {seeds} (model initialisation and batch order) for the three methods, "
        "each loss ratio taken against the baseline of the same seed; variants: seed 0",
        f"  all-reduce reference: 2(N-1)/N x {b.evaluator_params:,} params x {b.grad_bytes} B "
        f"per rank per step, N = {s.ranks} -> {_kb(b.allreduce_bytes_per_token())} per token",
        "",
        f"  {'method (mean over seeds)':40s} {'loss':>7s} {'sd':>6s} {'/base':>6s} {'sd':>6s} "
        f"{'sent/token':>11s} {'/allred':>8s} {'recv/token':>11s} {'wall s':>7s} "
        f"{'train s':>8s} {'merges':>6s}",
    ]

    def row(runs: list[Result], name: str | None = None) -> str:
        r0 = runs[0]
        loss, loss_sd = _mean_sd([r.loss for r in runs])
        ratio, ratio_sd = _mean_sd([b.loss_ratio(r) for r in runs])
        tok = statistics.fmean(max(r.tokens, 1) for r in runs)
        if r0.method.kind == "zero3":
            sent = recv = b.allreduce_bytes_per_token()
            share = "1"
        else:
            sent = statistics.fmean(r.bytes_up for r in runs) / tok
            recv = statistics.fmean(r.bytes_down for r in runs) / tok
            br = statistics.fmean(b.bytes_ratio(r) for r in runs)
            share = f"1/{1 / br:.0f}" if br else "-"
        loss_sd = f"{loss_sd:6.3f}" if len(runs) > 1 else " " * 6
        ratio_sd = f"{ratio_sd:6.3f}" if len(runs) > 1 and r0.method.kind != "zero3" else " " * 6
        return (
            f"  {name or r0.method.label:40s} {loss:7.4f} {loss_sd} {ratio:6.3f} "
            f"{ratio_sd} {_kb(sent):>11s} {share:>8s} {_kb(recv):>11s} "
            f"{statistics.fmean(r.wall_s for r in runs):7.1f} "
            f"{statistics.fmean(r.train_s for r in runs):8.1f} "
            f"{statistics.fmean(r.merges for r in runs):6.0f}"
        )

    init = [r.initial for r in res["zero3"]]
    ratio0 = statistics.fmean(r.initial / r.loss for r in res["zero3"])
    lines.append(f"  {'initial model':40s} {statistics.fmean(init):7.4f} {'':6s} {ratio0:6.3f}")
    for key in (*MAIN, FIXED):
        if key in res:
            lines.append(row(res[key]))
    dec = b.summary("decoupled")
    br = statistics.fmean(b.bytes_ratio(r) for r in res["decoupled"])
    per_seed = ", ".join(f"{x:.3f}" for x in dec["ratios"])
    met, bytes_met = dec["ratio_mean"] <= LOSS_GOAL, br <= BYTES_GOAL
    ratio = shown(dec["ratio_mean"], LOSS_GOAL, met)[0]
    # br <= goal reads as 1/br >= 1/goal: 1/99.6 must not print as 1/100 beside MISSED
    per_token, per_goal = shown(1 / br, 1 / BYTES_GOAL, bytes_met, at_most=False, least=0)
    lines += [
        f"  goals (Decoupled DiLoCo): loss ratio {ratio} (mean of {seeds} "
        f"seed(s): {per_seed}; sd {dec['ratio_sd']:.3f}, standard error {dec['ratio_se']:.3f}) "
        f"<= {LOSS_GOAL} {'met' if met else 'MISSED'}; sent per token 1/{per_token} of the "
        f"all-reduce <= 1/{per_goal} {'met' if bytes_met else 'MISSED'}",
    ]
    if "sync" in res:
        sy = b.summary("sync")
        lines.append(
            f"    sync DiLoCo's loss ratio {sy['ratio_mean']:.3f} (sd {sy['ratio_sd']:.3f}); "
            f"Decoupled / sync, paired by seed: "
            + ", ".join(
                f"{d.loss / y.loss:.3f}"
                for d, y in zip(res["decoupled"], res["sync"], strict=False)
            )
        )

    lines += [
        "",
        "  contributions: sent by the islands, merged / dropped as stale by the coordinator "
        "(the rest still waited at the end); steps: share of the inner steps in merged and "
        "dropped ones that were dropped; ovw: steps overwritten by versions merged without "
        "their island:",
        f"  {'run':24s} {'seed':>4s} {'loss':>7s} {'/base':>6s} {'sent':>5s} {'merged':>6s} "
        f"{'dropped':>7s} "
        f"{'steps':>6s} {'ovw':>5s}  {'per island merged/dropped':24s} {'staleness':>10s}  quorum",
    ]
    for runs in res.values():
        for r in runs:
            if r.islands:
                lines.append(
                    f"  {r.method.key:24s} {r.method.seed:4d} {r.loss:7.4f} "
                    f"{b.loss_ratio(r):6.3f} {_counts(r)}"
                )

    main = res["decoupled"][0]
    if FIXED in res:
        lines.append(
            "    phase alignment: Decoupled with it / with a fixed send phase, paired by seed: "
            + ", ".join(
                f"{d.loss / f.loss:.3f}" for d, f in zip(res["decoupled"], res[FIXED], strict=False)
            )
        )
    variants = [k for k in res if k not in (*MAIN, FIXED) and not k.startswith("hetero-")]
    if variants:
        lines += [
            "",
            "  variants of Decoupled DiLoCo (seed 0; first row: the main run of seed 0):",
        ]
        lines.append(row([main], f"    decoupled ({main.method.codec}, main run)"))
        order = {f"codec-{c}": i for i, c in enumerate(CODECS)}
        for key in sorted(variants, key=lambda k: order.get(k, -1)):
            r = res[key][0]
            lines.append(row([r], f"    {key} ({r.method.codec})"))
    if "hetero-decoupled" in res:
        h = res["hetero-decoupled"][0]
        fast = statistics.median(h.step_s[1:]) if len(h.step_s) > 1 else float("nan")
        base = b.baseline(0)
        lines += [
            "",
            f"  heterogeneous (seed 0): island 0 sleeps {h.method.slow_s * 1e3:.0f} ms after "
            f"each step (median step {h.step_s[0] * 1e3:.0f} ms vs {fast * 1e3:.0f} ms for the "
            f"others) and trains {s.steps // 2} steps; the others {s.steps}",
        ]
        for key in ("hetero-decoupled", "hetero-stale-decoupled", "hetero-sync"):
            if key in res:
                r = res[key][0]
                lines.append(row([r], f"    {key}"))
                lines.append(
                    f"      ({r.method.label}): loss / homogeneous Decoupled "
                    f"{r.loss / main.loss:.3f}, wall {r.wall_s:.0f} s vs {main.wall_s:.0f} s, "
                    f"{r.tokens:,} tokens"
                )
        lock = base.train_s + s.steps * h.method.slow_s
        lines.append(
            f"    lock-step ZeRO-3 with that rank (estimate): every step waits for it: "
            f"training {base.train_s:.0f} s + {s.steps} x {h.method.slow_s * 1e3:.0f} ms = "
            f"{lock:.0f} s for the baseline's {base.tokens:,} tokens"
        )
    return "\n".join(lines)


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def format_tune(picks: dict, seeds: int) -> list[str]:
    """The tuning-split losses by (outer lr, momentum), mean over ``seeds``, and the picks."""
    lines = []
    for kind, losses in picks.items():
        best = min(losses, key=lambda k: statistics.fmean(losses[k]))
        cells = ", ".join(
            f"{lr:g}/{mom:g}: {statistics.fmean(v):.4f}" for (lr, mom), v in losses.items()
        )
        lines.append(
            f"  {kind}: tuning-split loss (mean of {seeds} seed(s)) by outer lr/momentum "
            f"{cells} -> lr {best[0]:g}, momentum {best[1]:g}"
        )
    return lines


def plot(b: QualityBench, path: Path) -> Path:
    """Held-out loss against tokens: the three methods (every seed) and the variants, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (key, runs) in enumerate(b.results.items()):
        main = key in MAIN
        for r in runs:
            x, y = zip(*r.curve)
            first = r is runs[0]
            label = r.method.label + (f" ({len(runs)} seeds)" if len(runs) > 1 else "")
            ax.plot(
                x, y, "-o" if main else "--", ms=3 if first else 2, lw=(2 if main else 1) if first
                else 0.8, color=colors[i % len(colors)], label=label if first else None,
                alpha=1.0 if first else 0.6,
            )  # fmt: skip
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("held-out loss")
    s = b.setup
    ax.set_title(
        f"{Path(s.model_config).stem}: M={s.islands}, H={s.sync_every}, P={s.num_fragments}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
