"""The `localpaged` command: parses arguments and calls the rooms that do the work."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

DEFAULT_MODEL = "smollm2:135m"
DEFAULT_PORT = 11435  # Ollama uses 11434


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="memory for the KV cache")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="the KV cache's element type (default auto: the model's, float16 for a "
                        "float32 model on the CPU)")


def _add_step_bound_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-step-ms", type=float, default=None, metavar="MS",
                   help="how long a step may take while chats stream and a prompt is read "
                        "(default: about 2x a decode-only step, learned, at least 100; 0: no bound)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="localpaged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="answer one chat turn, streamed to stdout")
    run.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                     help=f"model name, HF folder or .gguf file (default {DEFAULT_MODEL})")
    run.add_argument("prompt", nargs="?", default=None, help="the message (default: stdin)")
    run.add_argument("--system", default=None, help="system prompt")
    run.add_argument("--temperature", type=float, default=0.7)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--max-tokens", type=int, default=512)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--json", action="store_true", help="print one JSON object at the end")
    _add_engine_args(run)
    run.set_defaults(handler=_lazy("localpaged.engine.run_command", "run"))

    chat = sub.add_parser("chat", help="the terminal chat app")
    chat.add_argument("model", nargs="?", default=None)
    chat.add_argument("--remote", default=None, help="chat with an OpenAI-compatible server URL")
    chat.add_argument("--serve", action="store_true", help="also serve the localhost API")
    chat.add_argument("--local", action="store_true", help="never attach to a running server")
    chat.add_argument("--port", type=int, default=DEFAULT_PORT)
    _add_engine_args(chat)
    _add_step_bound_arg(chat)
    chat.set_defaults(handler=_lazy("localpaged.chat_launcher", "main"))

    serve = sub.add_parser("serve", help="serve the OpenAI- and Ollama-compatible API")
    serve.add_argument("model", nargs="?", default=None)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--allowed-host", action="append", default=[],
                       help="extra Host header value to accept (repeatable)")
    serve.add_argument("--allowed-origin", action="append", default=[],
                       help="extra CORS origin to allow (repeatable)")
    serve.add_argument("--max-loaded-models", type=int, default=3, metavar="N",
                       help="models kept loaded at once; the least recently used idle one is "
                            "unloaded for another (default: 3)")
    serve.add_argument("--memory-budget", type=float, default=None, metavar="GB",
                       help="memory all loaded models may hold (weights and KV cache); default: "
                            "90%% of the memory free at start (the GPU's on CUDA, else RAM)")
    serve.add_argument("--keep-alive", default="5m", metavar="DURATION",
                       help="how long an idle model stays loaded when a request says nothing "
                            "(Ollama's keep_alive: '5m', '1h', '0', '-1' for ever; default: 5m)")
    _add_engine_args(serve)
    _add_step_bound_arg(serve)
    serve.set_defaults(handler=_lazy("localpaged.server.app", "main"))

    pull = sub.add_parser("pull", help="download a model")
    pull.add_argument("model")
    pull.set_defaults(handler=_lazy("localpaged.store.commands", "pull"))

    lst = sub.add_parser("list", help="list pulled models")
    lst.set_defaults(handler=_lazy("localpaged.store.commands", "list_models"))

    show = sub.add_parser("show", help="describe a model")
    show.add_argument("model")
    show.set_defaults(handler=_lazy("localpaged.store.commands", "show"))

    rm = sub.add_parser("rm", help="remove a pulled model")
    rm.add_argument("model")
    rm.set_defaults(handler=_lazy("localpaged.store.commands", "rm"))

    imp = sub.add_parser("import", help="register a local .gguf file under a name")
    imp.add_argument("file")
    imp.add_argument("--name", required=True)
    imp.set_defaults(handler=_lazy("localpaged.store.commands", "import_gguf"))

    quant = sub.add_parser("quantize", help="quantize a model to 4-bit GPTQ or AWQ")
    quant.add_argument("model")
    quant.add_argument("--method", choices=["gptq", "awq"], required=True)
    quant.add_argument("--group-size", type=int, default=128)
    quant.add_argument("--calib", default=None, help="calibration text file")
    quant.add_argument("--output", default=None, help="output folder (default: registered name)")
    quant.set_defaults(handler=_lazy("localpaged.quant.commands", "quantize"))
    return parser


def _lazy(module: str, func: str) -> Callable[[argparse.Namespace], int | None]:
    def call(args: argparse.Namespace) -> int | None:
        import importlib

        return getattr(importlib.import_module(module), func)(args)

    return call


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `localpaged` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"localpaged: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
