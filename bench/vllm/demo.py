"""``make vllm-demo``: Lynx inside vLLM. A producer and a consumer vLLM instance (two
processes, CPU, one thread each) on the default model, a ~2k-token prompt, the
producer's link shaped to 1 Gbit/s by Lynx's shaper; every scheme through
:class:`lynx_vllm.connector.LynxConnector`, interleaved over ``--repeats`` rounds,
beside the consumer prefilling by itself and vLLM's built-in ``ExampleConnector``.

Clocks (wall clock, both instances on one host):

``ttft_s``
    the consumer's: from the moment its request is submitted (the producer
    already holds the prefilled cache, Lynx's ``t0``) to its first output
    token: the pull request, the transfer, loading into the paged blocks
    layer by layer and the forward pass of the last prompt token. Median of
    the rounds.
``ttft_with_prefill_s``
    what a user of the two-instance deployment waits for: the producer's
    prefill (its request from submission to its one token) plus ``ttft_s``.
``no_transfer_ttft_s``
    the consumer prefilling the whole prompt itself (no disaggregation).
``example_connector_ttft_s``
    vLLM's ``ExampleConnector`` on the same prompt: it goes through a local
    folder (safetensors files), not a link, so it is vLLM's built-in way, not a
    network baseline.

Writes ``OUT/result.json`` (``schemes`` with ``scheme``, ``ttft_s``, ``text``,
``equal_to_reference``, ``bytes_on_wire``; ``reference_text`` (the consumer's
own greedy output without disaggregation), ``example_connector_ttft_s``,
``no_transfer_ttft_s``, and the configuration) and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lynx_bench.common.errors import VllmNodeError
from lynx_bench.common.progress import progress_bar
from lynx_bench.vllm.driver import INSTALL_HINT, VllmNode, free_port, vllm_python

__all__ = ["main", "run"]

SCHEMES = ("bf16", "int8", "int4", "lynx")


def _prompt(model_dir: Path, tokens: int) -> list[int]:
    from tokenizers import Tokenizer  # noqa: PLC0415 - the model extra

    from lynx_bench.accuracy.workload import passkey_prompt  # noqa: PLC0415 - needs the tokenizer too

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text).ids)

    return encode(passkey_prompt(encode, tokens, 0.5, seed=1).prompt)


def _detok(model_dir: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer  # noqa: PLC0415

    return str(Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids))


def _stats(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _checked(answer: dict[str, Any], what: str) -> dict[str, Any]:
    if answer.get("error"):
        raise VllmNodeError(f"{what}: {answer['error']}")
    return answer


def run(model_dir: Path, out: Path, *, tokens: int = 2048, new_tokens: int = 16, repeats: int = 5,
        bandwidth_gbps: float = 1.0, port: int = 0, python: Path | None = None) -> dict[str, Any]:
    python = python or vllm_python()
    if python is None:
        raise VllmNodeError(f"no vLLM environment: {INSTALL_HINT}")
    out.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    stats_path = out / "loads.jsonl"
    stats_path.unlink(missing_ok=True)
    ids = _prompt(model_dir, tokens)
    warm = ids[:200]
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in (*SCHEMES, "no_transfer")}
    bar = progress_bar(total=4 + repeats * (len(SCHEMES) + 1) + 3, disable=False, unit="step")
    try:
        bar.set_postfix_str("starting the producer and the consumer (vLLM, ~15-30 s each)")
        producer, consumer = _start(
            dict(python=python, model=model_dir, connector="lynx", role="kv_producer", log=out / "producer.log",
                 extra={"port": port, "bandwidth_gbps": bandwidth_gbps}),
            dict(python=python, model=model_dir, connector="lynx", role="kv_consumer", log=out / "consumer.log",
                 extra={"stats_path": str(stats_path)}))
        bar.update(2, timed=False)  # start-up and warm-ups say nothing of a measured step's time
        with producer, consumer:
            # warm up both instances and every scheme's path (JIT, connections), off the clock
            bar.phase("warm-up: every scheme's path")
            warm_params = _checked(producer.prefill(warm), "producer warm-up")["kv_transfer_params"]
            for scheme in SCHEMES:
                _checked(consumer.generate(warm, 2, kv_transfer_params=_with_scheme(warm_params, scheme)),
                         f"consumer warm-up ({scheme})")
            bar.update(1, timed=False)
            bar.phase(f"warm-up: a prefill of {len(ids)} tokens")
            _checked(producer.prefill(ids), "producer warm-up at full length")
            bar.update(1, timed=False)
            prefills: list[float] = []
            for _ in range(repeats):
                held = _checked(producer.prefill(ids), "producer prefill")  # held again, each round
                prefills.append(held["e2e_s"])
                params = held["kv_transfer_params"]
                for scheme in (*SCHEMES, "no_transfer"):
                    bar.set_postfix_str(scheme)
                    p = None if scheme == "no_transfer" else _with_scheme(params, scheme)
                    rows[scheme].append(_checked(consumer.generate(ids, new_tokens, kv_transfer_params=p), scheme))
                    bar.update(1)
        loads = [r for r in _stats(stats_path) if r["prompt_tokens"] == len(ids)]
        bar.set_postfix_str("vLLM's ExampleConnector")
        example_ttft = _example_connector(python, model_dir, ids, new_tokens, out)
        bar.update(3)
    finally:
        bar.close()
    reference = rows["no_transfer"][0]["token_ids"]
    result: dict[str, Any] = {
        "config": {"model": str(model_dir), "prompt_tokens": len(ids), "new_tokens": new_tokens,
                   "repeats": repeats, "bandwidth_gbps": bandwidth_gbps, "threads_per_instance": 1,
                   "clock": "ttft_s: consumer request submitted (the producer holds the prefilled cache) "
                            "-> first output token; ttft_with_prefill_s adds the producer's prefill"},
        "producer_prefill_s": statistics.median(prefills),
        "reference_text": _detok(model_dir, reference),
        "no_transfer_ttft_s": statistics.median(r["ttft_s"] for r in rows["no_transfer"]),
        "example_connector_ttft_s": example_ttft,
        "schemes": [],
    }
    for scheme in SCHEMES:
        result["schemes"].append(_scheme_row(model_dir, scheme, rows[scheme], loads, reference,
                                             result["producer_prefill_s"]))
    int8 = next(s for s in result["schemes"] if s["scheme"] == "int8")
    lynx = next(s for s in result["schemes"] if s["scheme"] == "lynx")
    lynx["equal_to_int8"] = all(a["token_ids"] == b["token_ids"] for a, b in zip(rows["lynx"], rows["int8"]))
    int8["equal_to_int8"] = True
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return result


def _scheme_row(model_dir: Path, scheme: str, runs: list[dict[str, Any]], loads: list[dict[str, Any]],
                reference: list[int], prefill_s: float) -> dict[str, Any]:
    """One scheme's entry of ``result.json``'s ``schemes``, from its rounds and the consumer's load records."""
    mine = [r for r in loads if r.get("asked_scheme", r["scheme"]) == scheme]
    ttft = statistics.median(r["ttft_s"] for r in runs)
    return {
        "scheme": scheme, "ttft_s": ttft, "ttft_with_prefill_s": prefill_s + ttft,
        "ttft_runs_s": [r["ttft_s"] for r in runs],
        "text": _detok(model_dir, runs[0]["token_ids"]),
        "equal_to_reference": all(r["token_ids"] == reference for r in runs),
        "bytes_on_wire": mine[0]["bytes_on_wire"] if mine else None,
        # what was pulled: lynx's default split is auto (possibly none: then int8)
        "pulled": sorted({(r["scheme"], str(r.get("planes"))) for r in mine}),
        "split_choice": mine[-1].get("split_choice") if mine else None,
        "loads_ok": sum(1 for r in mine if r["error"] is None and r["layers_loaded"] > 0),
    }


def _start(*specs: dict[str, Any]) -> list[VllmNode]:
    """Start instances in parallel (each loads for tens of seconds); all or none."""
    with cf.ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(lambda kw: VllmNode(kw.pop("python"), kw.pop("model"), **kw), dict(spec))
                   for spec in specs]
        done = [f.exception() is None for f in futures]
        if not all(done):
            for f, ok in zip(futures, done):
                if ok:
                    f.result().close()
            raise next(f.exception() for f, ok in zip(futures, done) if not ok)  # type: ignore[misc]
        return [f.result() for f in futures]


def _with_scheme(params: dict[str, Any], scheme: str) -> dict[str, Any]:
    p = json.loads(json.dumps(params))
    p["lynx"]["scheme"] = scheme
    return p


def _example_connector(python: Path, model_dir: Path, ids: list[int], new_tokens: int, out: Path) -> float:
    """vLLM's ExampleConnector: the producer writes safetensors files to a folder, the consumer reads them."""
    storage = Path(tempfile.mkdtemp(prefix="lynx-example-connector-"))
    try:
        producer, consumer = _start(
            dict(python=python, model=model_dir, connector="example", role="kv_producer", storage=str(storage),
                 log=out / "example-producer.log"),
            dict(python=python, model=model_dir, connector="example", role="kv_consumer", storage=str(storage),
                 log=out / "example-consumer.log"))
        with producer, consumer:
            _checked(producer.generate(ids, 1), "example producer")
            _checked(consumer.generate(ids[:200], 2), "example consumer warm-up")
            runs = [_checked(consumer.generate(ids, new_tokens), "example consumer")["ttft_s"] for _ in range(3)]
        return statistics.median(runs)
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def checks(result: dict[str, Any]) -> dict[str, bool]:
    """The demo's targets (the vLLM issue's): each True when met."""
    by = {s["scheme"]: s for s in result["schemes"]}
    return {
        "ttft(int8) < 0.6 x ttft(bf16)": by["int8"]["ttft_s"] < 0.6 * by["bf16"]["ttft_s"],
        "every scheme below no_transfer_ttft_s": all(s["ttft_s"] < result["no_transfer_ttft_s"]
                                                     for s in result["schemes"]),
        "bf16 equals the reference": bool(by["bf16"]["equal_to_reference"]),
        "lynx equals int8": bool(by["lynx"].get("equal_to_int8")),
    }


def table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    bf16 = next(s for s in result["schemes"] if s["scheme"] == "bf16")["ttft_s"]
    lines = [f"vLLM + LynxConnector: {cfg['prompt_tokens']} prompt tokens, {cfg['new_tokens']} new, "
             f"{cfg['bandwidth_gbps']:g} Gbit/s, median of {cfg['repeats']} interleaved rounds",
             f"{'scheme':<22}{'ttft_s':>9}{'vs bf16':>9}{'+prefill':>10}{'MB on wire':>12}  output",
             ]
    for s in result["schemes"]:
        same = "= reference" if s["equal_to_reference"] else "differs from reference"
        if s["scheme"] == "lynx":
            same += ", = int8" if s.get("equal_to_int8") else ", differs from int8"
        mb = f"{s['bytes_on_wire'] / 1e6:.1f}" if s["bytes_on_wire"] else "-"
        lines.append(f"{s['scheme']:<22}{s['ttft_s']:>9.3f}{s['ttft_s'] / bf16:>9.2f}"
                     f"{s['ttft_with_prefill_s']:>10.3f}{mb:>12}  {same}")
    lines.append(f"{'no transfer (prefill)':<22}{result['no_transfer_ttft_s']:>9.3f}"
                 f"{result['no_transfer_ttft_s'] / bf16:>9.2f}{'':>10}{'-':>12}  the reference")
    lines.append(f"{'ExampleConnector':<22}{result['example_connector_ttft_s']:>9.3f}"
                 f"{result['example_connector_ttft_s'] / bf16:>9.2f}{'':>10}{'(disk)':>12}  vLLM's built-in, "
                 "through a local folder")
    lines.append(f"producer prefill (median): {result['producer_prefill_s']:.3f} s (the +prefill column adds it); "
                 f"reference: {result['reference_text']!r}")
    for name, ok in checks(result).items():
        lines.append(f"check: {name}: {'yes' if ok else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lynx_bench.vllm.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("vllm-demo-out"))
    p.add_argument("--model", type=Path, default=None, help="a transformers directory (default: Lynx's default model)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bandwidth", type=float, default=1.0, help="the producer's link, Gbit/s")
    args = p.parse_args(argv)
    if args.model is None:
        from lynx_decode.model.store import converted_model_dir, default_gguf_path  # noqa: PLC0415 - model extra

        args.model = converted_model_dir(default_gguf_path())
    started = time.monotonic()
    try:
        result = run(args.model, args.out, tokens=args.tokens, new_tokens=args.new_tokens, repeats=args.repeats,
                     bandwidth_gbps=args.bandwidth)
    except VllmNodeError as exc:
        print(f"vllm-demo: {exc}", file=sys.stderr)
        return 1
    print(table(result))
    print(f"wrote {args.out / 'result.json'} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
