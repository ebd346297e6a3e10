"""The GPU run's results as the docs' tables, and the targets they are measured against.

``python -m hf_kvcache.tools.gpu_run.render RUN_DIR`` prints the markdown; ``--save NAME`` also stores the run as
``docs/results/NAME.json`` (``{"command", "kind": "gpu-run", "results": {stage: record}}``, what
``scripts/build_results.py`` renders into a ``<!-- results:NAME -->`` region of ``docs/results.md``, adding the region
under the page's GPU section if it has none).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tabulate import tabulate

from .runner import STAGES

__all__ = ["load_run", "render", "save_run", "targets"]

GIB = 2**30
NONE_YET = "No GPU run has been saved yet."  # the results page's GPU section before its first run


def load_run(folder: Path) -> dict:
    """``{"command", "kind", "results": {stage: record}}`` of a run's folder (a stage that wrote nothing is absent)."""
    results = {}
    for stage in ("run", *STAGES):
        path = folder / f"{stage}.json"
        if path.exists():
            results[stage] = json.loads(path.read_text())
    if not results:
        raise ValueError(f"{folder} holds no run.json or stage JSON: not the output folder of a GPU run")
    # A run whose run.json did not come back (a transfer's limits) still has its stages' own records.
    command = results.get("run", {}).get("command", "gpu_run (its run.json did not come back)")
    return {"command": command, "kind": "gpu-run", "results": results}


def _table(headers: list[str], rows: list[list]) -> str:
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def _env(run: dict) -> list[str]:
    env = run.get("env", {})
    info = env.get("info", {})
    copy = next((i["bytes_per_s"] for i in env.get("items", []) if i.get("measure") == "copy bandwidth"), None)
    peak = info.get("peak_bandwidth")
    bw = f"peak {peak / 1e12:.2f} TB/s ({info.get('peak_bandwidth_source')})" if peak else "peak unknown"
    measured = f", a device-to-device copy reaches {copy / 1e12:.2f} TB/s" if copy else ""
    memory = info.get("memory_bytes")
    return [
        f"**{info.get('device_name')}** ({info.get('capability', 'n/a')}, {info.get('sms', 'n/a')} SMs, "
        f"{memory / GIB:.0f} GiB)"
        if memory
        else f"**{info.get('device_name')}**",
        f"; memory bandwidth {bw}{measured}. torch {info.get('torch')} (CUDA {info.get('cuda')}), triton "
        f"{info.get('triton')}, transformers {info.get('transformers')}, accelerate {info.get('accelerate')}, "
        f"python {info.get('python')}.",
    ]


def _fallbacks(run: dict) -> list[str]:
    """Kernels the machine's Triton could not build, per stage (the reference served them)."""
    lines = []
    for stage in STAGES:
        for name, why in (run.get(stage, {}).get("info", {}).get("kernel_fallbacks") or {}).items():
            lines.append(f"- {stage}: the Triton kernel `{name}` fell back to the reference: `{why}`")
    return lines


def _stages(run: dict) -> str:
    rows = []
    stages = run.get("run", {}).get("stages")
    if stages is None:  # no run.json: each stage's record says how it ended and how long it ran
        stages = [{"stage": st, "status": run[st].get("status", "?"), "wall_s": run[st].get("elapsed_s", 0)}
                  for st in STAGES if st in run]  # fmt: skip
    for s in stages:
        record = run.get(s["stage"], {})
        extra = f"{len(record.get('errors', []))} errors, {len(record.get('skipped', []))} skipped for time"
        rows.append([s["stage"], s["status"], f"{s.get('box_s', 0):.0f}", f"{s.get('wall_s', 0):.0f}", extra])
    return _table(["stage", "ended", "box s", "wall s", ""], rows)


def _ratio(error, tolerance: float) -> float:
    """An error over its tolerance; a non-finite error (recorded as the string ``"nan"``) ranks worst."""
    error = float(error)
    return error / tolerance if error == error else float("inf")


def _correctness(record: dict) -> str:
    rows = []
    for check in ("decode", "encode", "model", "saved"):
        mine = [i for i in record.get("items", []) if i["check"] == check]
        if check == "saved" and not mine:  # runs before 2026-12-03 had no such check
            continue
        failed = [i for i in mine if not i["passed"]]
        worst = ""
        if check == "saved" and mine:  # exact: the largest difference, with no tolerance to divide by
            top = max(mine, key=lambda i: float(i["max_error"]))
            worst = f"{float(top['max_error']):.2e} ({top['kind']}, {top['dtype'][6:]}; must be 0)"
        elif check != "encode" and mine:
            key = "max_error" if check == "decode" else "max_error_over_std"
            top = max(mine, key=lambda i: _ratio(i[key], i["tolerance"]))
            worst = f"{float(top[key]):.2e} ({top['kind']}, {top['dtype'][6:]}; tolerance {top['tolerance']:.0e})"
        elif mine:
            low = min(mine, key=lambda i: min(i["identical_bytes"].values()))
            share = min(low["identical_bytes"].values())
            worst = f"{share:.4%} identical bytes ({low['kind']}, {low['dtype'][6:]})"
        names = ", ".join(f"{i['kind']} {i['dtype'][6:]}" + (f" q={i['q_len']}" if "q_len" in i else "")
                          for i in failed)  # fmt: skip
        rows.append([check, f"{len(mine) - len(failed)} / {len(mine)}", worst, names or "none"])
    errors = [f"- {e['item']}: `{e['error'][:200]}`" for e in record.get("errors", [])]
    return _table(["check", "passed", "worst", "failed"], rows) + ("\n\n" + "\n".join(errors) if errors else "")


def _kernels(record: dict) -> str:
    info = record.get("info", {})
    rows = []
    graphs = any("graph_us" in i or "graph_error" in i for i in record.get("items", []))
    for i in record.get("items", []):
        if i.get("measure") in ("host", "variant"):
            continue
        row = [
            f"{i['context']:,} x {i['batch']}", i["kind"] + (f" ({i['backend']})" if "backend" in i else ""),
            f"{i['median_us']:.1f}", f"{i['p10_us']:.1f}-{i['p90_us']:.1f}",
            f"{i['speedup_vs_sdpa']:.2f}" if "speedup_vs_sdpa" in i else "1.00", f"{i['bytes'] / 2**20:.1f}",
            f"{i['of_peak']:.0%}" if "of_peak" in i else "n/a",
        ]  # fmt: skip
        if graphs:
            row += [f"{i['graph_us']:.1f}" if "graph_us" in i else "n/a",
                    f"{i['graph_speedup_vs_sdpa']:.2f}" if "graph_speedup_vs_sdpa" in i else "n/a",
                    f"{i['graph_of_peak']:.0%}" if "graph_of_peak" in i else "n/a"]  # fmt: skip
        rows.append(row)
    head = (f"One decode step of one layer, {info.get('heads')} query / {info.get('kv_heads')} KV heads, head_dim "
            f"{info.get('head_dim')}, {str(info.get('dtype', ''))[6:]}; Triton kernels: "
            f"{'yes' if info.get('triton') else 'no (' + str(info.get('triton_error')) + ')'}.")  # fmt: skip
    columns = ["context x batch", "kind", "µs (median)", "p10-p90", "x sdpa", "MiB read", "of peak BW"]
    if graphs:
        head += (" The step as issued from Python, then as one CUDA-graph replay: the device's time alone (sdpa's "
                 "replay the base of its ratio).")  # fmt: skip
        columns += ["device µs", "device x sdpa", "device of peak BW"]
    return head + "\n\n" + _table(columns, rows) + _host(record) + _variants(record)


def _host(record: dict) -> str:
    """The host profile's rows: issue time against device time per call, syncs, the top Python functions."""
    items = [i for i in record.get("items", []) if i.get("measure") == "host"]
    if not items:
        return ""
    rows = [[f"{i['context']:,} x {i['batch']}", i["kind"], f"{i['host_us_per_call']:.1f}",
             f"{i['wall_us_per_call']:.1f}", "n/a" if i["syncs_per_call"] is None else str(i["syncs_per_call"]),
             "; ".join(f"{f['function']} {f['own_us_per_step']:.1f}" for f in i["python_functions"][:4])]
            for i in items]  # fmt: skip
    return (
        "\n\nWhere a call's time goes on the host (a call issued back to back without waiting for the device, µs "
        "per call; the four Python functions with the most own time, µs per call under cProfile):\n\n"
        + _table(["context x batch", "kind", "host µs", "with device µs", "syncs", "top Python functions"], rows)
    )


def _variants(record: dict) -> str:
    """Launch-plan variants beside the plan the formats chose: issued and device-only time, their ratios (above 1:
    the variant is faster) and the largest difference of its output from the plan's."""
    items = [i for i in record.get("items", []) if i.get("measure") == "variant"]
    if not items:
        return ""
    rows = [[f"{i['context']:,} x {i['batch']}", i["kind"], i["plan"] or "(the format's plan)", f"{i['median_us']:.1f}",
             f"{i['speedup_vs_plan']:.2f}" if "speedup_vs_plan" in i else "",
             f"{i['graph_us']:.1f}" if "graph_us" in i else "n/a",
             f"{i['graph_speedup_vs_plan']:.2f}" if "graph_speedup_vs_plan" in i else "",
             f"{i['max_diff_vs_plan']:.1e}" if "max_diff_vs_plan" in i else ""]
            for i in items]  # fmt: skip
    return (
        "\n\nLaunch-plan variants waiting for a GPU to decide them, each beside the plan the formats choose (x plan "
        "above 1: the variant is faster; max diff: its output against the plan's):\n\n"
        + _table(["context x batch", "kind", "plan", "µs", "x plan", "device µs", "device x plan", "max diff"], rows)
    )


def _generate(record: dict) -> str:
    info = record.get("info", {})
    items = record.get("items", [])
    base = {(i["context"], i["batch"]): i for i in items if i["measure"] == "decode" and i["cache"] == "dynamic"}
    decode = []
    for i in (i for i in items if i["measure"] == "decode"):
        ref = base.get((i["context"], i["batch"]))
        over = i["decode_peak_bytes"] - i["weights_bytes"] - i["cache_bytes"] if i["decode_peak_bytes"] else None
        decode.append([
            f"{i['context']:,} x {i['batch']}", f"{i['cache']} [{i['attn']}]", f"{i['decode_tokens_per_s']:.1f}",
            f"{i['decode_tokens_per_s'] / ref['decode_tokens_per_s']:.2f}" if ref else "n/a",
            f"{i['step_ms_median']:.1f}", f"{i['cache_bytes'] / GIB:.2f}",
            f"{i['decode_peak_bytes'] / GIB:.2f}" if i["decode_peak_bytes"] else "n/a",
            f"{over / (i['weights_bytes'] + i['cache_bytes']):+.1%}" if over is not None else "n/a",
        ])  # fmt: skip
    fits = [i for i in items if i["measure"] == "largest batch"]
    dyn = next((_largest(i) for i in fits if i["cache"] == "dynamic"), None)
    fit_rows = [_fit_row(i, dyn) for i in fits]
    ttft = [i for i in items if i["measure"] == "ttft"]
    tbase = {(i["context"], i["batch"]): i["ttft_s"] for i in ttft if i["cache"] == "dynamic"}
    ttft_rows = [[f"{i['context']:,} x {i['batch']}", f"{i['cache']} [{i['attn']}]", f"{i['ttft_s']:.3f}",
                  f"{i['ttft_s'] / tbase[(i['context'], i['batch'])]:.2f}" if (i["context"], i["batch"]) in tbase
                  else "n/a"] for i in ttft]  # fmt: skip
    parts = [
        f"{info.get('model')}, {info.get('layers')} layers, {str(info.get('dtype', ''))[6:]}, weights "
        f"{info.get('weights_bytes', 0) / GIB:.1f} GiB. Decode: the cache filled with the context, then "
        "`generate()` timed step by step.",
        _table(
            [
                "context x batch",
                "cache [attention]",
                "decode tok/s",
                "x dynamic",
                "step ms",
                "cache GiB",
                "decode peak GiB",
                "peak over weights + cache",
            ],
            decode,
        ),  # fmt: skip
    ]
    if fit_rows:
        context = fits[0]["context"]
        parts += [
            f"Largest batch at {context:,} tokens that fills and decodes in the device's memory, found by "
            "running, next to `hf-kvcache plan`'s answer for the same memory:",
            _table(["cache [attention]", "largest batch", "x dynamic", "plan", "measured / plan"], fit_rows),
        ]
    if ttft_rows:
        parts += [
            "Time to first token (a real prefill through the cache):",
            _table(["context x batch", "cache [attention]", "TTFT s", "x dynamic"], ttft_rows),
        ]
    profiled = [i for i in items if i["measure"] == "decode" and "profile" in i]
    if profiled:
        rows = []
        for i in profiled:
            p = i["profile"]
            top = "; ".join(f"{t['name']} {t['share']:.0%}" for t in p["top"][:4])
            rows.append([f"{i['context']:,} x {i['batch']}", f"{i['cache']} [{i['attn']}]",
                         f"{p['wall_ms_per_step']:.1f}", f"{p['kernel_ms_per_step']:.1f}",
                         f"{p['kernel_ms_per_step'] / p['wall_ms_per_step']:.0%}", f"{p['launches_per_step']:.0f}",
                         top])  # fmt: skip
        unit = "kernels" if profiled[0]["profile"]["activity"] == "cuda" else "operators (CPU)"
        parts += [
            f"Where a decode step's time goes: {profiled[0]['profile']['steps']} more steps of the same cache under "
            f"`torch.profiler`, the summed time of its {unit} against the step's wall time (a low ratio: the host "
            "issues the step slower than the device runs it):",
            _table(
                ["context x batch", "cache [attention]", "step ms", f"{unit} ms", "busy", "launches", "largest shares"],
                rows,
            ),  # fmt: skip
        ]
    return "\n\n".join(parts)


def _quality(record: dict) -> str:
    info = record.get("info", {})
    columns = sorted({(i["device"], i["dtype"][6:], i["attn"]) for i in record.get("items", [])})
    values = {(i["cache"], i["device"], i["dtype"][6:], i["attn"]): i["perplexity"] for i in record.get("items", [])}
    caches = list(dict.fromkeys(i["cache"] for i in record.get("items", [])))
    rows = [[c] + [f"{values[(c, *col)]:.3f}" if (c, *col) in values else "" for col in columns] for c in caches]
    head = (f"Perplexity through each cache: {info.get('model')}, {info.get('tokens')} tokens of the held-out text, "
            f"windows of {info.get('context')} ({info.get('prefill')} prefilled, {info.get('chunk')} tokens per "
            "scored forward).\n\n")  # fmt: skip
    return head + _table(["cache"] + [f"{d} {t} [{a}]" for d, t, a in columns], rows)


def _largest(item: dict) -> int | None:
    """A largest-batch search's answer; None when its time box ended before any batch was found to fit (runs before
    the search said so itself recorded 0, not exact)."""
    found = item["largest_batch"]
    return None if found is None or (found == 0 and not item["exact"]) else found


def _fit_row(item: dict, dynamic: int | None) -> list[str]:
    """``[cache, largest batch, x dynamic's, plan's answer, x the plan's]`` for one largest-batch search."""
    found, planned = _largest(item), item["planned_batch"]
    return [
        f"{item['cache']} [{item['attn']}]",
        _largest_cell(item),
        f"{found / dynamic:.2f}" if dynamic and found is not None else "n/a",
        str(planned),
        f"{found / planned:.2f}" if planned and found is not None else "n/a",
    ]


def _largest_cell(item: dict) -> str:
    found = _largest(item)
    if found is None:
        failed = [int(b) for b, ok in item["tried"].items() if not ok]
        return f"< {min(failed)} (time box ended)" if failed else "not searched"
    return str(found) + ("" if item["exact"] else " (not exact)")


def _met(ok: bool) -> str:
    return "yes" if ok else "no"


def targets(run: dict) -> list[list[str]]:
    """The GPU targets of the project (issue: decode on a real GPU) against this run: ``[what, target, measured,
    met]`` rows, for the cells the run measured."""
    rows = []
    kernels = [i for i in run.get("kernels", {}).get("items", []) if i.get("measure") not in ("host", "variant")]
    want = {"int8": 1.6, "int4": 2.5, "int3": 2.5, "int2": 2.5, "paged": 0.95, "paged int8": 1.6, "dense": 0.9}
    for kind, goal in want.items():
        cell = next((i for i in kernels if i["kind"] == kind and (i["context"], i["batch"]) == (16384, 8)), None)
        if cell:
            got = cell["speedup_vs_sdpa"]
            rows.append([f"kernel vs sdpa, 16k x 8: {kind}", f">= {goal}", f"{got:.2f}", _met(got >= goal)])
    for kind, goal in want.items():
        cell = next((i for i in kernels if i["kind"] == kind and (i["context"], i["batch"]) == (16384, 8)), None)
        if cell and "graph_speedup_vs_sdpa" in cell:
            got = cell["graph_speedup_vs_sdpa"]
            what = f"kernel vs sdpa, device only, 16k x 8: {kind}"
            rows.append([what, f">= {goal}", f"{got:.2f}", _met(got >= goal)])
    for kind in ("dense", "int8", "paged"):
        cell = next((i for i in kernels if i["kind"] == kind and (i["context"], i["batch"]) == (16384, 8)), None)
        if cell and "of_peak" in cell:
            ok = cell["of_peak"] >= 0.7
            rows.append([f"bandwidth, 16k x 8: {kind}", ">= 70%", f"{cell['of_peak']:.0%}", "yes" if ok else "no"])
        if cell and "graph_of_peak" in cell:
            got = cell["graph_of_peak"]
            rows.append([f"bandwidth, device only, 16k x 8: {kind}", ">= 70%", f"{got:.0%}", _met(got >= 0.7)])
    items = run.get("generate", {}).get("items", [])
    decode = {(i["cache"], i["attn"]): i for i in items if i["measure"] == "decode" and (i["context"], i["batch"])
              == (32768, 8)}  # fmt: skip
    base = decode.get(("dynamic", "sdpa"))
    for kind, goal in (("int4", 1.5), ("int8", 1.3)):
        mine = decode.get((kind, "hf_kvcache"))
        if base and mine:
            got = mine["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            rows.append([f"generate 32k x 8 decode: {kind}", f">= {goal}x", f"{got:.2f}x", _met(got >= goal)])
    for (kind, attn), i in decode.items():
        if attn == "hf_kvcache" and i["decode_peak_bytes"]:
            over = i["decode_peak_bytes"] / (i["weights_bytes"] + i["cache_bytes"]) - 1
            rows.append([f"decode peak 32k x 8: {kind}", "<= +10%", f"{over:+.1%}", "yes" if over <= 0.1 else "no"])
    fits = {i["cache"]: _largest(i) for i in items if i["measure"] == "largest batch"}
    planned = {i["cache"]: i["planned_batch"] for i in items if i["measure"] == "largest batch"}
    if fits.get("dynamic") is not None:
        for kind, goal in (("int4", 3.0), ("int8", 1.8)):
            if fits.get(kind) is not None:
                got = fits[kind] / max(fits["dynamic"], 1)
                rows.append([f"largest batch 32k: {kind}", f">= {goal}x dynamic", f"{got:.2f}x",
                             _met(got >= goal)])  # fmt: skip
        for kind, found in fits.items():
            if found is not None:
                off = found / max(planned[kind], 1) - 1
                rows.append([f"largest batch vs plan: {kind}", "within 10%", f"{off:+.0%}", _met(abs(off) <= 0.1)])
    ttft = {(i["cache"], i["context"], i["batch"]): i["ttft_s"] for i in items if i["measure"] == "ttft"}
    for (kind, context, batch), seconds in ttft.items():
        ref = ttft.get(("dynamic", context, batch))
        if kind != "dynamic" and ref and (context, batch) == (32768, 8):
            rows.append([f"TTFT 32k x 8: {kind}", "<= 1.1x", f"{seconds / ref:.2f}x", _met(seconds <= 1.1 * ref)])
    wall = run.get("run", {}).get("wall_s")
    if wall is not None and not run["run"].get("smoke"):
        rows.append(["the run's wall time", "<= 480 s", f"{wall:.0f} s", "yes" if wall <= 480 else "no"])
    return rows


def render(record: dict) -> str:
    """Markdown of a saved GPU run (``load_run``'s dictionary)."""
    run = record["results"]
    sections = ["```bash", record["command"], "```", "", "".join(_env(run)), "", _stages(run)]
    fallbacks = _fallbacks(run)
    if fallbacks:
        sections += ["", *fallbacks]
    titled = (("Correctness on the device", "correctness", _correctness), ("Decode kernels", "kernels", _kernels),
              ("generate() end to end", "generate", _generate), ("Quality", "quality", _quality))  # fmt: skip
    for title, stage, fn in titled:
        if stage in run:
            sections += ["", f"**{title}**", "", fn(run[stage])]
    rows = targets(run)
    if rows:
        sections += ["", "**Targets**", "", _table(["what", "target", "measured", "met"], rows)]
    return "\n".join(sections)


def save_run(folder: Path, name: str, docs: Path) -> Path:
    """Store the run as ``docs/results/NAME.json`` and make sure ``docs/results.md`` has its region."""
    record = load_run(folder)
    path = docs / "results" / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    page = docs / "results.md"
    text = page.read_text()
    region = f"<!-- results:{name} -->"
    if region not in text:
        anchor = "<!-- gpu-runs -->"
        if anchor not in text:
            raise ValueError(f"{page} has no '{anchor}' line to add the run's region under")
        text = text.replace(anchor, f"{anchor}\n\n{region}\n<!-- /results -->", 1)
        page.write_text(text.replace(f"\n\n{NONE_YET}", ""))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_run.render", description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a GPU run's output folder")
    parser.add_argument("--save", metavar="NAME", help="store it as docs/results/NAME.json (and its region)")
    parser.add_argument("--docs", type=Path, default=Path("docs"), help="the docs folder (default: docs)")
    args = parser.parse_args(argv)
    try:
        record = load_run(args.run)
        if args.save:
            print(f"saved {save_run(args.run, args.save, args.docs)}", file=sys.stderr)
    except (OSError, ValueError) as err:
        print(f"gpu_run.render: {err}", file=sys.stderr)
        return 2
    print(render(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
