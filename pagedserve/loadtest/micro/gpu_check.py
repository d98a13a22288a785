"""The prepared GPU check (issue 24): proves the CUDA path on a lent GPU in one call.

    python -m pagedserve.loadtest.micro.gpu_check [--out $OUT/gpu_check.json] [--only kernels,serve]
    python -m pagedserve.loadtest.micro.gpu_check --dry-run      # here, on the CPU, small shapes (the test)
    python -m pagedserve.loadtest.micro.gpu_check --set sizes    # the second call: the 8B shape, bf16 and fp8

How to run it on the lent machine (the wheels and the tokenizer it carries, the exact call):
docs/gpu-check.md. Each phase runs in its own subprocess under its own timeout; its record (status
pass / fail / skip, the reason, its checks and figures) is appended to the JSON file after it
ends, and a failing, hanging or crashing phase never stops the next. All phases together stay
under 9 minutes on a bare H100; no network is used.

| phase | on the GPU | in --dry-run (CPU) |
|---|---|---|
| kernels | Triton decode / prefill / prefix-cached attention and the KV write vs the torch reference and a float64 one: head_dim 64/80/128, GQA 9/3 and 32/8, blocks 8/16/32, fp32/bf16/fp16, contexts to 3000, NaN in unowned slots; a CUDA graph replayed after its tables change in place | the same under TRITON_INTERPRET=1 on two small cases; the graph part eager in place of the replay (no CUDA) |
| model | a random Llama (head_dim 64, the default vocabulary) in fp32: prompt logprobs vs transformers (<= 1e-4) with chunked prefill; greedy 48 tokens x 8 prompts, eager and with graphs, equal to generate(do_sample=False); bf16 agreement reported | the same, 12 tokens x 3 prompts, graphs = the padded static-buffer path |
| graphs | greedy equality eager vs graphs at batch 1, 3, 8, 37, 64, 200, 256, 300; start-up time and memory of capture; decode step time and LLM tokens/s both ways | batch 1, 3, 8 |
| serve | a real `serve` on a random model: greedy equals offline, a streamed chat ends with [DONE], 64 concurrent requests, /metrics, SIGTERM exits 0 | the same on the CPU |
| lora | tiny model, 2 random adapters, fp32: greedy tokens with graphs equal eager, row for row: both adapters and base rows in a batch padded to a capture size, one adapter on every row, then base-only steps; the adapter steps replayed graphs | the same, the padded static-buffer path |
| decode_1b | a ~1B random Llama (hidden 2048, 16 layers, 32/8 heads, bf16): decode step time with graphs (and eager) at batch 1/16/64/256 vs (weights + KV bytes) / measured copy bandwidth; LLM tokens/s | a small model, batch 1 and 4 |
| refusals | fp8 KV and int8 / int4 on CUDA refused cleanly, fp8 weights on a GPU before compute capability 8.9 and on the CPU; a model whose position table is below max_num_batched_tokens starts (the profile forward); a sampling step of each common kind reads the GPU once (loadtest/micro/gpu_check_sampler.py) | the refusal checks on a CUDA device name; the profile forward on the CPU; the sampler's read count |

``--set sizes`` (issue 41; loadtest/micro/gpu_check_sizes.py), a second call of its own 8 minutes:

| phase | on the GPU | in --dry-run (CPU) |
|---|---|---|
| decode_8b | the Llama 3.1 8B shape, random bf16 weights: decode step with graphs (and eager) at batch 1/16/64/256, context 1,024, vs the floor | a small model, batch 1 and 4 |
| fp8_8b | the same under --quantization fp8: the steps vs the fp8 floor; greedy agreement with bf16 | the same small model through the CPU's torch._scaled_mm |
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from pagedserve.loadtest.micro.gpu_check_common import Ctx, Report, Skip
from pagedserve.loadtest.micro.gpu_check_decode import phase_decode_1b
from pagedserve.loadtest.micro.gpu_check_kernels import phase_kernels
from pagedserve.loadtest.micro.gpu_check_lora import phase_lora
from pagedserve.loadtest.micro.gpu_check_model import phase_graphs, phase_model
from pagedserve.loadtest.micro.gpu_check_refusals import phase_refusals
from pagedserve.loadtest.micro.gpu_check_serve import phase_serve
from pagedserve.loadtest.micro.gpu_check_sizes import phase_decode_8b, phase_fp8_8b

ROOT = Path(__file__).resolve().parents[3]  # the checkout (above pagedserve/)
# (phase, seconds it may take on a bare H100): 480 s in all (the 8 minutes), inside the call's 540 s.
PHASES = {"kernels": 100, "model": 75, "graphs": 80, "lora": 35, "serve": 70, "decode_1b": 85, "refusals": 35}
# The second call (``--set sizes``, issue 41): the 8B shape in bf16 and fp8, 480 s in all as well.
SIZES_PHASES = {"decode_8b": 200, "fp8_8b": 280}
PHASE_SETS = {"check": PHASES, "sizes": SIZES_PHASES}
DRY_RUN_TIMEOUT_S = 60  # per phase in --dry-run (the test's whole budget is 2 minutes)


# ---- the runner -----------------------------------------------------------------------------------

PHASE_FUNCTIONS = {"kernels": phase_kernels, "model": phase_model, "graphs": phase_graphs, "lora": phase_lora,
                   "serve": phase_serve, "decode_1b": phase_decode_1b, "refusals": phase_refusals,
                   "decode_8b": phase_decode_8b, "fp8_8b": phase_fp8_8b}


def run_phase(name: str, ctx: Ctx, result_path: str) -> int:
    """In the phase's own process: run it, write its record."""
    rep = Report()
    record = {"phase": name, "status": "pass", "reason": None}
    t0 = time.perf_counter()
    try:
        PHASE_FUNCTIONS[name](ctx, rep)
        failed = [c["name"] for c in rep.checks if not c["ok"]]
        if failed:
            record.update(status="fail", reason="failed: " + "; ".join(failed))
        elif not rep.checks and not rep.figures:
            record.update(status="skip", reason="nothing ran")
    except Skip as e:
        record.update(status="skip", reason=str(e))
    except Exception as e:  # noqa: BLE001 - the record says what broke; the next phase still runs
        traceback.print_exc()
        record.update(status="fail", reason=f"{type(e).__name__}: {e}"[:2000])
    record.update(seconds=round(time.perf_counter() - t0, 2), checks=rep.checks, figures=rep.figures,
                  skipped_parts=rep.skipped)
    Path(result_path).write_text(json.dumps(record, default=str, indent=1))
    return 0


def run_with_timeout(cmd: list[str], env: dict, timeout: float) -> tuple[str, int | None]:
    """Run a phase in a process group of its own; past the timeout, kill the whole group (a
    server the phase started too, so it holds no GPU memory into the next phase). -> (output,
    exit code or None on timeout)."""
    import signal

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = None
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the phase left running in its group
    except ProcessLookupError:
        pass
    return output, code


def _device_info(dry_run: bool) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "dry_run": dry_run}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, memory_gib=props.total_memory / 2**30, sms=props.multi_processor_count)
    import importlib.metadata

    packages = {}  # what the server imports, carried or the image's: a version, or why not
    for name in ("triton", "transformers", "tokenizers", "starlette", "uvicorn", "sse-starlette", "anyio", "orjson",
                 "pydantic", "msgspec", "httptools", "gguf", "xgrammar", "httpx", "uvloop", "prometheus-client"):
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = "MISSING"
    info["packages"] = packages
    return info


def _model_dir(assets: str, dry_run: bool) -> str:
    carried = Path(assets) / "model"
    if (carried / "tokenizer.json").is_file():
        return str(carried.resolve())
    if not dry_run:
        raise SystemExit(f"{carried} is missing: run `python -m pagedserve.loadtest.micro.gpu_check_prepare` here first "
                         "and carry .gpu_check (docs/gpu-check.md)")
    from pagedserve.loadtest.micro.gpu_check_prepare import export_model_dir

    made = Path(tempfile.mkdtemp(prefix="gpu-check-model-"))
    export_model_dir(made)  # from the default model's GGUF, present where the suite runs
    return str(made)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run here on the CPU, small shapes (the test)")
    parser.add_argument("--out", default=None, help="JSON file of the phase records (default $OUT/gpu_check.json, "
                                                    "else ./gpu_check.json)")
    parser.add_argument("--set", default="check", choices=list(PHASE_SETS),
                        help="check: the seven phases (default); sizes: the 8B shape in bf16 and fp8 (issue 41), "
                             "the second prepared call")
    parser.add_argument("--only", default=None, help="comma-separated phases of the set (default all): "
                                                     + "; ".join(", ".join(p) for p in PHASE_SETS.values()))
    parser.add_argument("--assets", default=str(ROOT / ".gpu_check"), help="the prepared folder (model/, wheels/)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase in this process
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        return run_phase(args.phase, Ctx(args.dry_run, args.model_dir), args.result)

    phases = PHASE_SETS[args.set]
    names = args.only.split(",") if args.only else list(phases)
    unknown = set(names) - set(phases)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)} in --set {args.set}; choose from {', '.join(phases)}")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            from pagedserve.gpu.device import cuda_unavailable_reason

            raise SystemExit(f"no CUDA device: {cuda_unavailable_reason()} (use --dry-run on a CPU)")
    out = Path(args.out or os.path.join(os.environ.get("OUT") or ".", "gpu_check.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    model_dir = _model_dir(args.assets, args.dry_run)
    report = {"device": _device_info(args.dry_run), "phases": []}
    print(json.dumps(report["device"]), flush=True)
    out.write_text(json.dumps(report, indent=1))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    with open(log, "w") as log_file, tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name in names:
            timeout = DRY_RUN_TIMEOUT_S if args.dry_run else phases[name]
            result = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "pagedserve.loadtest.micro.gpu_check", "--phase", name, "--result", str(result),
                   "--model-dir", model_dir] + (["--dry-run"] if args.dry_run else [])
            phase_env = dict(env, TRITON_INTERPRET="1") if args.dry_run and name == "kernels" else env
            print(f"== {name} (timeout {timeout} s)", flush=True)
            log_file.write(f"== {name}\n")
            log_file.flush()
            t0 = time.perf_counter()
            output, code = run_with_timeout(cmd, phase_env, timeout)
            log_file.write(output)
            log_file.flush()
            sys.stdout.write(output[-3000:])
            if result.is_file():
                record = json.loads(result.read_text())
            else:
                why = f"timed out after {timeout} s" if code is None else f"its process exited with {code}"
                record = {"phase": name, "status": "fail", "reason": f"{why}; output tail: {output[-1500:]}",
                          "seconds": round(time.perf_counter() - t0, 2), "checks": [], "figures": {}}
            report["phases"].append(record)
            out.write_text(json.dumps(report, default=str, indent=1))
    print(f"\n{'phase':10s} {'status':6s} {'seconds':>8s}  reason")
    for r in report["phases"]:
        print(f"{r['phase']:10s} {r['status']:6s} {r['seconds']:8.1f}  {(r.get('reason') or '')[:150]}")
    print(f"records: {out}; log: {log}")
    return 1 if any(r["status"] == "fail" for r in report["phases"]) else 0


if __name__ == "__main__":
    sys.exit(main())
