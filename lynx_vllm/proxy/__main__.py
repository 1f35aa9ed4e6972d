"""``python -m lynx_vllm.proxy``: serve the disaggregated proxy (:mod:`lynx_vllm.proxy`) with uvicorn.

    python -m lynx_vllm.proxy --prefill 127.0.0.1:8100 --decode 127.0.0.1:8200 --port 8000 --scheme lynx

Logs one line per request (its id, both legs' status and times) to stderr; exits non-zero when the
arguments are bad or FastAPI/uvicorn/httpx are missing (with what to install).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys

from lynx_decode.codec.config import Scheme
from lynx_vllm.config import planes_of
from lynx_vllm.errors import ConnectorError
from lynx_vllm.proxy import INSTALL_HINT, ProxyConfig, Upstream, create_app
from lynx_vllm.proxy.legs import Codec

__all__ = ["main", "parse_args"]

SCHEMES = ("bf16", "int8", "int4", "lynx")


def parse_args(argv: list[str] | None = None) -> tuple[ProxyConfig, argparse.Namespace]:
    """The proxy's settings from the command line (exits with the reason when they are bad)."""
    p = argparse.ArgumentParser(prog="python -m lynx_vllm.proxy",
                                description="An OpenAI-compatible front for a LynxConnector producer "
                                            "(prefill) and consumer (decode) vLLM server.")
    p.add_argument("--prefill", required=True, metavar="HOST:PORT", help="the producer's vLLM server")
    p.add_argument("--decode", required=True, metavar="HOST:PORT", help="the consumer's vLLM server")
    p.add_argument("--host", default="127.0.0.1", help="where the proxy listens (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="(default %(default)s)")
    p.add_argument("--scheme", choices=SCHEMES, default=None,
                   help="how the consumer pulls caches, unless a request says (default: the consumer's "
                        "kv_connector_extra_config)")
    p.add_argument("--planes", default=None, metavar="W,W|auto",
                   help="the lynx plane split, e.g. 4,4 or 2,2,4, or auto (default: the consumer's)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="bound on each wait of a leg: connect, the prefill's answer, the decode's headers "
                        "and each wait for more of its body (default %(default)s s)")
    p.add_argument("--stats-path", default=None, metavar="FILE",
                   help="append each request's timestamps to FILE (JSON lines); GET /lynx/requests has the last ones")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    args = p.parse_args(argv)
    try:
        codec = Codec(Scheme(args.scheme) if args.scheme else None,
                      planes_of(args.planes) if args.planes else None)
        config = ProxyConfig(Upstream.parse(args.prefill), Upstream.parse(args.decode), codec,
                             timeout_s=args.timeout, stats_path=args.stats_path)
    except ConnectorError as exc:
        p.error(str(exc))
    return config, args


def main(argv: list[str] | None = None) -> int:
    config, args = parse_args(argv)
    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"python -m lynx_vllm.proxy: {', '.join(missing)} not installed; {INSTALL_HINT}", file=sys.stderr)
        return 2
    import uvicorn  # noqa: PLC0415 - an optional dependency

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "debug":  # httpx logs every request at INFO: the proxy's own line says more
        logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("lynx_vllm.proxy").info(
        "proxy on %s:%d: prefill %s, decode %s, codec %s, timeout %g s", args.host, args.port, config.prefill.url,
        config.decode.url, config.codec.params() or "the consumer's", config.timeout_s)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_config=None, access_log=False,
                ws="none", log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
