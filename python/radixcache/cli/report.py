"""What the commands print: the report tables (rich), the progress bar, the verdict, the plot.

`_report_table` (a replay), `_fleet_table` (a replay on several servers), `_bench_table`
and `ops_table` (a bench) build the tables, `_render` writes them as stdout shows them and
`_emit` prints; `_verdict` says on stderr why a run failed. `_plot` draws ``--plot``'s
figure (matplotlib, loaded only then). The rows' terms: `radixcache.glossary`.
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from ..serving.scheduler import StepSample
from .flags import OutputError
from .interrupts import _Interrupts


def _emit(text: str) -> None:
    """Print `text` on stdout; OutputError when it cannot be written (a full disk)."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except OSError as e:
        # Nothing more can reach stdout: point it at /dev/null so that the interpreter's
        # own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise OutputError(f"cannot write to stdout ({e.strerror})") from None


def _progress(err: Any, quiet: bool) -> Any:
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        "eta",
        TimeRemainingColumn(),
        console=err,
        disable=quiet,
        transient=True,
    )


def _causes(causes: dict[str, int]) -> str:
    """Return the L3 errors by cause, most first (``"3 connection refused, 1 timeout"``)."""
    if not causes:
        return "no errors"
    order = sorted(causes.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{n} {cause}" for cause, n in order)


def _failures(r: dict[str, Any]) -> list[str]:
    """Why a run failed (empty: it did not)."""
    why = []
    if r.get("mismatches", 0):
        why.append(f"{r['mismatches']} oracle mismatches")
    if r.get("audit", "pass") != "pass":
        why.append("the audit failed")
    if not r["pools_full_at_end"]:
        why.append("a pool is not full once the cache is cleared (a leak)")
    if r["rejected"]:
        why.append(f"{r['rejected']} requests rejected (no room even alone)")
    return why


def _verdict(prog: str, r: dict[str, Any]) -> int:
    why = _failures(r)
    if why:
        print(f"{prog}: failed: {'; '.join(why)}", file=sys.stderr)
    return 1 if why else 0


def _bench_table(r: dict[str, Any]) -> Any:
    """Return bench's report (but the table of operations) as a rich table."""
    head = Table(
        title=f"radixcache bench: {escape(str(r['workload']))}", show_header=False, box=None
    )
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_column(style="dim")
    head.add_row("requests", str(r["requests"]), f"{r['prompt_tokens']} prompt tokens")
    head.add_row("tokens passed as", r["tokens"])
    head.add_row("eviction policy", *_policy_text(r["eviction_policy"], r["model"]))
    head.add_row("model", r["model"])
    head.add_row(
        "device hit rate", f"{100 * r['hit_rate']:.1f}%", "device hit tokens / prompt tokens"
    )
    head.add_row(
        "cache time per request",
        f"{r['us_per_request']:.1f} us",
        f"median; p99 {r['p99_us']:.1f} us, mean {r['mean_us_per_request']:.1f} us",
    )
    head.add_row("per prompt token", f"{r['ns_per_prompt_token']:.1f} ns")
    head.add_row(
        "cache time in all",
        f"{r['cache_seconds']:.3f} s",
        f"of {r['wall_seconds']:.3f} s (the rest is the scheduler)",
    )
    head.add_row(
        "memory", f"{r['rss_growth_mb']:.1f} MB", f"process peak {r['peak_rss_mb']:.0f} MB"
    )
    head.add_row("pools full at end", str(r["pools_full_at_end"]), "after clearing: no leak")
    return head


def ops_table(ops: dict[str, dict[str, Any]], title: str, limit: int | None = None) -> Any:
    """Return a rich table of per-operation figures (``bench``'s ``ops``), `limit` rows."""
    table = Table(title=title)
    for col in ("operation", "calls", "p50 us", "p99 us", "share"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for name, o in list(ops.items())[:limit]:
        table.add_row(
            name,
            str(o["calls"]),
            f"{o['p50_us']:.2f}",
            f"{o['p99_us']:.2f}",
            f"{100 * o['share']:.1f}%",
        )
    return table


def _render(*tables: Any) -> str:
    """Render rich tables as stdout would show them (colour on a terminal only)."""
    stdout = Console()
    text = io.StringIO()
    console = Console(
        file=text,
        force_terminal=stdout.is_terminal,
        color_system=stdout.color_system,  # type: ignore[arg-type]
        width=stdout.width,
    )
    for t in tables:
        console.print(t)
    return text.getvalue().rstrip("\n")


def _report_table(r: dict[str, Any]) -> Any:
    """Return the replay's report as a rich table."""
    t = Table(title=f"radixcache replay: {escape(str(r['workload']))}", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")

    def row(name: str, value: Any, note: str = "") -> None:
        t.add_row(name, str(value), note)

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    row("requests", r["requests"], f"{r['retractions']} retractions, {r['rejected']} rejected")
    row("prompt tokens", r["prompt_tokens"], f"{r['prefill_tokens']} computed")
    row("output tokens", r["output_tokens"])
    row("eviction policy", *_policy_text(r["eviction_policy"], r["model"]))
    wait, over = r["queue_wait_steps"], r["overtaken"]
    row(
        "schedule policy",
        r["schedule_policy"],
        f"{r['steps']} scheduler steps"
        + (
            ""
            if r["schedule_window"] is None
            else f"; window {r['schedule_window']}, at most {r['max_overtakes']} overtakes"
        )
        + (f"; lookahead {r['lookahead']}" if r["lookahead"] else ""),
    )
    if r["lookahead"]:
        row("queue cuts", r["queue_cuts"], "where waiting prompts branch off")
    row(
        "queue wait",
        f"{wait['mean']:.0f} steps",
        f"mean; p99 {wait['p99']:.0f}, max {wait['max']:.0f}; overtaken mean "
        f"{over['mean']:.1f}, p99 {over['p99']:.0f}, max {over['max']:.0f}",
    )
    model, swa = r["model"], r["swa_window"] > 0
    row("model", model, f"window {r['swa_window']} tokens" if swa else "")
    row(
        "device hit tokens",
        r["device_hit_tokens"],
        f"{pct(r['device_hit_rate'])} on the device",
    )
    row(
        "host hit tokens",
        r["host_hit_tokens"],
        f"{pct(r['host_hit_rate'])} loaded back from the host",
    )
    if r["restored_hit_tokens"]:
        restored = pct(r["restored_hit_tokens"] / r["prompt_tokens"])
        note = f"{restored} device KV, its state from the host"
        row("restored hit tokens", r["restored_hit_tokens"], note)
    if r["l3_breaker"] is not None:
        row(
            "L3 hit tokens",
            r["l3_hit_tokens"],
            f"{pct(r['l3_hit_rate'])} fetched from L3, then loaded back",
        )
    tiers = "device + host" + (" + L3" if r["l3_breaker"] is not None else "")
    row("hit rate, all tiers", pct(r["hit_rate"]), tiers)
    if r["l3_breaker"] is not None:
        row(
            "L3 store",
            f"{r['l3_bytes_fetched'] / 1e6:.1f} MB fetched",
            f"{r['l3_fetch_gbps']:.2f} GB/s; {r['l3_bytes_stored'] / 1e6:.1f} MB stored, "
            f"{r['l3_put_gbps']:.2f} GB/s; {r['l3_corrupt_objects']} corrupt, "
            f"{r['l3_foreign_objects']} foreign, {r['l3_missing_objects']} missing",
        )
        row(
            "L3 errors",
            r["l3_errors"],
            f"breaker {r['l3_breaker']}; {_causes(r['l3_error_causes'])}",
        )
        if r["l3_prefetches"]:
            row(
                "L3 prefetches",
                r["l3_prefetches"],
                f"in the background; {r['l3_prefetch_timeouts']} called off, "
                f"{r['l3_prefetch_wait_steps']} steps waited in all",
            )

    def compared(name: str, rate: float | None, ratio: float | None, label: str) -> None:
        # A comparison replay's hit rate and the ratio to it ("not run" when skipped).
        shown = "n/a" if ratio is None else f"{ratio:.3f}"
        row(
            name, "n/a" if rate is None else pct(rate), "not run" if rate is None else label + shown
        )

    compared(
        "attention-only device hit rate",
        r["attention_only_hit_rate"],
        r["hit_rate_ratio"],
        f"{model}/attention ",
    )
    if swa:
        compared(
            "full-attention device hit rate",
            r["full_attention_hit_rate"],
            r["swa_vs_full_hit_ratio"],
            f"SWA as full attention; {model}/full ",
        )
    attn_saved = r["attention_only_compute_saved_ratio"]
    row(
        "compute saved",
        pct(r["compute_saved_ratio"]),
        "prefill FLOPs, all tiers"
        + ("" if attn_saved is None else f"; attention-only {pct(attn_saved)}"),
    )
    bound = r["offline_bound_hit_rate"]
    if bound is not None:
        b_ratio = r["offline_bound_ratio"]
        row(
            "offline bound",
            pct(bound),
            "device; "
            + ("" if b_ratio is None else f"hybrid/attention {b_ratio:.3f}; ")
            + f"LRU model {pct(r['offline_lru_hit_rate'])}",
        )
    row("copy-on-write copies", r["cow_copies"], f"{r['checkpoints']} checkpoints")
    row("backups", r["backups"], f"{r['backups_failed']} failed")
    row("demotions", r["demotions"], "kept on the host")
    reasons = ", ".join(f"{k} {v}" for k, v in r["load_backs_called_off_by_reason"].items() if v)
    row("load-backs committed", r["load_backs_committed"], f"{r['loaded_tokens']} tokens")
    row("load-backs called off", r["load_backs_called_off"], reasons)
    row("load-backs failed", r["load_backs_failed"], "after commit: recomputed")
    row(
        "evicted",
        f"{r['evicted_kv_tokens']} KV",
        f"{r['evicted_mamba_states']} states ({r['evicted_used_states']} used by a match)",
    )
    row("host evicted", f"{r['host_evicted_tokens']} KV")
    if swa:
        row(
            "SWA pages freed",
            f"{r['swa_window_freed_pages']} by windows",
            f"{r['swa_evicted_pages']} evicted, {r['swa_tombstones']} tombstones,"
            f" {r['swa_revived_pages']} revived",
        )
    inj = r["injected_failures"]
    if any(inj.values()):
        row("injected failures", sum(inj.values()), ", ".join(f"{k} {v}" for k, v in inj.items()))
    row(
        "throughput",
        f"{r['requests_per_second']:.1f} req/s",
        f"{r['tokens_per_second']:.0f} tokens/s, {r['seconds']:.1f} s (incl. the model)",
    )
    good = "[green]{}[/green]", "[red]{}[/red]"
    row(
        "oracle mismatches",
        (good[0] if r["mismatches"] == 0 else good[1]).format(r["mismatches"]),
        f"of {r['samples_checked']} samples",
    )
    audit = r["audit"]
    row("audit", (good[0] if audit == "pass" else good[1]).format(escape(audit)))
    full = r["pools_full_at_end"]
    row("pools full at end", (good[0] if full else good[1]).format(full), "after clearing")
    return t


def _fleet_table(r: dict[str, Any]) -> Any:
    """Return a fleet replay's report as a rich table."""
    title = f"radixcache replay: {escape(str(r['workload']))} on {r['servers']} servers"
    t = Table(title=title, show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    t.add_row("requests", str(r["requests"]), f"{r['prompt_tokens']} prompt tokens")
    t.add_row(
        "fleet hit rate",
        pct(r["hit_rate"]),
        f"all tiers: device {pct(r['device_hit_rate'])}, host {pct(r['host_hit_rate'])}, "
        f"L3 {pct(r['l3_hit_rate'])}",
    )
    ratio = r["fleet_vs_single_ratio"]
    t.add_row(
        "one server, every request",
        pct(r["single_server_hit_rate"]),
        "all tiers, same pools; fleet/one " + ("n/a" if ratio is None else f"{ratio:.3f}"),
    )
    t.add_row(
        "fleet without L3", pct(r["fleet_without_l3_hit_rate"]), "all tiers, the same servers"
    )
    if r["l3_breaker"] is not None:
        t.add_row(
            "L3 store",
            f"{r['l3_bytes_fetched'] / 1e6:.1f} MB fetched",
            f"{r['l3_fetch_gbps']:.2f} GB/s; {r['l3_bytes_stored'] / 1e6:.1f} MB stored; "
            f"{r['l3_corrupt_objects']} corrupt, {r['l3_foreign_objects']} foreign",
        )
        breakers = ", ".join(f"{s['l3_breaker']} ({s['l3_errors']})" for s in r["per_server"])
        t.add_row(
            "L3 errors",
            str(r["l3_errors"]),
            f"breakers {breakers}; {_causes(r['l3_error_causes'])}",
        )
        if r["l3_prefetches"]:
            t.add_row(
                "L3 prefetches",
                str(r["l3_prefetches"]),
                f"{r['l3_prefetch_timeouts']} called off, "
                f"{r['l3_prefetch_wait_steps']} steps waited in all",
            )
    good = "[green]{}[/green]", "[red]{}[/red]"
    t.add_row(
        "oracle mismatches",
        (good[0] if r["mismatches"] == 0 else good[1]).format(r["mismatches"]),
        f"of {r['samples_checked']} samples",
    )
    t.add_row("audit", (good[0] if r["audit"] == "pass" else good[1]).format(escape(r["audit"])))
    full = r["pools_full_at_end"]
    t.add_row("pools full at end", (good[0] if full else good[1]).format(full), "every server")
    return t


def _policy_text(policy: dict[str, str], model: str) -> tuple[str, str]:
    """Return the eviction policy as a value and a note naming the others where they differ.

    The value is the states' policy in a model with states (``hybrid``, ``swa-hybrid``),
    else the KV's; a model without states has no states' policy to show.
    """
    states = model in ("hybrid", "swa-hybrid")
    first, first_name = ("mamba", "states") if states else ("kv", "KV")
    value = policy[first]
    others = [
        f"{name} {policy[key]}"
        for key, name in (("kv", "KV"), ("swa", "SWA"))
        if key != first and policy.get(key, value) != value
    ]
    return (value, f"{first_name}; " + ", ".join(others) if others else "")


def _import_matplotlib() -> Any:
    # Older matplotlib releases (the last ones for Python 3.9) warn about their own
    # dependencies while importing: not the user's concern. Ctrl-C is held off until
    # the import is done (then raised): inside it, C extensions turn it into an
    # ImportError, which would read as matplotlib missing.
    with _Interrupts(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    return plt


def plot_formats() -> list[str]:
    """Return the image formats ``--plot`` writes (matplotlib's but pgf: it needs LaTeX)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"})


def _plot(timeline: list[StepSample], path: str, title: str) -> None:
    plt = _import_matplotlib()
    fig = _figure(plt, timeline, title)
    try:
        fig.savefig(path, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)


def _figure(plt: Any, timeline: list[StepSample], title: str) -> Any:
    """Return the ``--plot`` figure: hit rates and pool occupancy against requests finished.

    The legends stand to the right of the axes, so that they never cover a curve.
    """
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, layout="constrained")
    x = [s.finished for s in timeline]
    dev = [s.device_hit_tokens / s.prompt_tokens if s.prompt_tokens else 0 for s in timeline]
    host = [
        (s.device_hit_tokens + s.host_hit_tokens) / s.prompt_tokens if s.prompt_tokens else 0
        for s in timeline
    ]
    a.plot(x, dev, label="device hits")
    a.plot(x, host, label="device + host hits")
    a.set_ylabel("hit rate (cumulative)")
    a.set_ylim(0, 1)
    a.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    a.set_title(f"radixcache replay: {title}")
    b.plot(x, [s.kv_used for s in timeline], label="device KV")
    b.plot(x, [s.mamba_used for s in timeline], label="device states")
    b.plot(x, [s.host_kv_used for s in timeline], label="host KV")
    b.set_ylabel("pool occupancy")
    b.set_ylim(0, 1.05)
    b.set_xlabel("requests finished")
    b.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig
