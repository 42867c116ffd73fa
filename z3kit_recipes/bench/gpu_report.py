"""The GPU check's report as text, and what in it fails the check."""

from __future__ import annotations

from typing import Any

from z3kit_recipes.bench.spec import JSON

MiB = 1 << 20
SECTION_TITLES = {
    "parity": "1. parity against plain single-device training",
    "host_syncs": "2. host syncs per training step (engine forward + backward + step)",
    "memory": "3. memory by phase: allocator peak against the engine's ledger",
    "large": "4. a ~1B Llama, bf16, world 1: tokens/s, MFU, and whether the host stays ahead of the device",
    "timing": "5. step time against FSDP2 (and DeepSpeed ZeRO-3 at world 2+), with optimizer offload, and Muon "
              "against Adam at world 1, fp32",
}


def failures(report: JSON) -> list[str]:
    """Why the check fails: no world ran, a world did not finish, a section raised, or a parity
    case is out of tolerance."""
    out: list[str] = []
    if all(r["status"] == "skipped" for r in report["worlds"].values()):
        out.append("no world ran: " + "; ".join(r["reason"] for r in report["worlds"].values()))
    for world, result in report["worlds"].items():
        if result["status"] == "skipped":
            continue
        if result["status"] != "ok":
            out.append(f"world {world}: {result.get('error', result['status'])}")
            continue
        for name, section in result["sections"].items():
            where = f"world {world} {name}"
            if "cases" not in section:  # the section itself raised
                out.append(f"{where}: {section.get('error', section['status'])}")
            elif name == "parity":
                out += [f"{where} {case}: " + (c.get("error") or "out of tolerance")
                        for case, c in section["cases"].items() if not c["passed"]]
            elif section["status"] != "ok":
                out += [f"{where} {case}: {c.get('error')}" for case, c in section["cases"].items()
                        if c["status"] != "ok"] or [f"{where}: {section.get('error', section['status'])}"]
    return out


def _size(n: int | None, sign: str = "") -> str:
    """Bytes in KiB, MiB or GiB, whichever reads best (``sign="+"``: a signed change)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= scale or unit == "KiB":
            return f"{n / scale:{sign}.1f} {unit}"
    raise AssertionError("unreachable")


def _g(x: Any) -> str:
    return "-" if x is None else f"{x:.2e}" if isinstance(x, float) else str(x)


def _parity(section: JSON) -> list[str]:
    lines = [f"   reference: {section['reference']}",
             f"   {'case':<12} {'steps':>5} {'max loss rel':>13} {'max |param|':>12} {'diff/update':>12} "
             f"{'tolerance':>17}  result"]
    for name, c in section["cases"].items():
        if c["status"] != "ok":
            lines.append(f"   {name:<12} ERROR {c['error']}")
            continue
        tol = c["tolerance"]
        lines.append(f"   {name:<12} {c['steps']:>5} {_g(c['max_loss_rel_diff']):>13} {_g(c['max_param_abs_diff']):>12} "
                     f"{_g(c['param_diff_rel_to_update']):>12} {_g(tol['loss_rel']) + ', ' + _g(tol['param_rel']):>17}  "
                     f"{'PASS' if c['passed'] else 'FAIL'}")
    return lines


def _host_syncs(section: JSON) -> list[str]:
    lines = [f"   {section['method']}; warm-up steps {section['warmup_steps']}, counted steps "
             f"{section['counted_steps']}; expected {section['expected']}"]
    for name, c in section["cases"].items():
        if c["status"] != "ok":
            lines.append(f"   {name:<12} ERROR {c['error']}")
            continue
        per_call = ", ".join(f"{call} {max(n, default=0)}" for call, n in c["per_call_per_step_rank0"].items())
        lines.append(f"   {name:<12} {c['syncs_per_step']} per step ({per_call}; per rank {c['per_step_per_rank']}); "
                     f"engine's own waits on the device {c.get('engine_host_waits_per_step', 0)} per step")
        steps = len(c["per_step_per_rank"][0]) or 1
        for call, sites in c["sites_rank0"].items():
            lines += [f"      {call}: {n / steps:g}/step {site}" for site, n in sites.items()]
        for call, calls in c["calls_rank0"].items():
            unlocated = sum(calls.values()) - sum(c["sites_rank0"][call].values())
            if unlocated > 0:
                lines.append(f"      {call}: {unlocated / steps:g}/step with no Python site: {sorted(calls)}")
    return lines


def _memory(section: JSON) -> list[str]:
    lines = [f"   {section['note']}"] if section["note"] else []
    for name, c in section["cases"].items():
        if c["status"] != "ok":
            lines.append(f"   {name:<12} ERROR {c['error']}")
            continue
        lines.append(f"   {name} (rank 0; {c['probe']} peak, its rise in the phase, what the ledger did not count "
                     "at the peak; the ledger's peak by kind):")
        for phase, p in c["phases"].items():
            kinds = ", ".join(f"{k} {_size(v)}" for k, v in p["ledger_peak_bytes"].items() if v)
            lines.append(f"      {phase:<8} {_size(p['allocator_peak_bytes'])} "
                         f"({_size(p['allocator_peak_above_start_bytes'], '+')}), outside the ledger "
                         f"{_size(p['outside_ledger_at_peak_bytes'])}; ledger {_size(p['ledger_peak_total_bytes'])}: "
                         f"{kinds}")
    return lines


def _timing(section: JSON) -> list[str]:
    lines = [f"   {section['note']}"] if section["note"] else []
    lines.append(f"   median s/step of {section['timed_steps']} timed steps (warm-up steps {section['warmup_steps']})")
    for name, c in section["cases"].items():
        parts = []
        for runtime in section["runtimes"]:
            r = c.get(runtime, {})
            parts.append(f"{runtime} {r['median_s']:.4f}" if r.get("status") == "ok" else
                         f"{runtime} {r.get('status', '-')}: {r.get('reason') or r.get('error', '')}")
        ratios = ", ".join(f"{k} {v:.2f}x" if v is not None else f"{k} -" for k, v in c.get("ratios", {}).items())
        lines.append(f"   {name:<6} {'; '.join(parts)}; {ratios}")
    return lines


_AHEAD = {True: "host ahead", False: "HOST BEHIND (the device waited)", None: "no device timing on CPU"}


def _large(section: JSON) -> list[str]:
    if "params" not in section:
        return [f"   {section['note']}"]
    lines = [f"   {section['note']}"] if section["note"] else []
    peak = section["peak_bf16_flops"]
    lines.append(f"   {section['params']:,} parameters, micro-batch {section['batch']} x sequence {section['seq']} "
                 f"({section['tokens_per_step']:,} tokens a step), bf16; MFU against "
                 f"{'-' if peak is None else f'{peak:.3g}'} FLOP/s ({section['peak_source']}); median of "
                 f"{section['timed_steps']} steps after {section['warmup_steps']}")
    for name, c in section["cases"].items():
        if c["status"] != "ok":
            lines.append(f"   {name:<6} ERROR {c['error']}")
            continue
        mfu = "-" if c["mfu"] is None else f"{c['mfu']:.1%}"
        lines.append(f"   {name:<6} {c['tokens_per_s']:,.0f} tokens/s ({c.get('tokens_per_s_x_plain', 0):.3f}x plain), "
                     f"MFU {mfu}; host {c['host_s'] * 1e3:.1f} ms to issue a step, device {c['device_s'] * 1e3:.1f} ms: "
                     f"{_AHEAD[c['host_ahead']]}; "
                     f"peak allocated {_size(c['peak_allocated_bytes'])}")
    return lines


RENDER = {"parity": _parity, "host_syncs": _host_syncs, "memory": _memory, "large": _large, "timing": _timing}


def render(report: JSON) -> str:
    lines = [f"z3kit GPU check: {report['device']}, torch {report['torch']}, {report['wall_s']:.1f} s"]
    if report["dry_run"]:
        lines.append("dry run: tiny models on CPU; timing and memory figures are NOT meaningful")
    for world, result in report["worlds"].items():
        if result["status"] == "skipped":
            lines.append(f"== world {world}: skipped ({result['reason']})")
            continue
        if result["status"] != "ok":
            lines.append(f"== world {world}: ERROR {result.get('error')}")
            continue
        lines.append(f"== world {world} ({result['backend']}, {result['device']}), {result['wall_s']:.1f} s")
        for name, section in result["sections"].items():
            lines.append(f"{SECTION_TITLES[name]}  [{section['status']}, {section['wall_s']:.1f} s]")
            if "cases" not in section:
                lines.append(f"   ERROR {section.get('error')}")
                continue
            lines += RENDER[name](section)
    fails = report["failures"]
    lines.append("result: PASS" if not fails else "result: FAIL\n" + "\n".join(f"  - {f}" for f in fails))
    return "\n".join(lines)
