"""The store's CLI subcommands: `pull`, `list`, `show`, `rm`, `import`."""

from __future__ import annotations

import argparse
import sys

from localpaged.store.catalog import load_catalog
from localpaged.store.lookup import ModelNotPulledError, list_pulled, remove, resolve
from localpaged.store.lookup import import_gguf as _import_gguf
from localpaged.store.progress import human_size
from localpaged.store.pulling import pull_model


def pull(args: argparse.Namespace) -> int:
    """`localpaged pull NAME`."""
    pull_model(args.model, progress=True)
    return 0


def list_models(args: argparse.Namespace) -> int:
    """`localpaged list`: name, format, size on disk, when pulled."""
    models = list_pulled()
    if not models:
        print("no models pulled yet; try `localpaged pull smollm2:135m`", file=sys.stderr)
        return 0
    rows = [("NAME", "FORMAT", "SIZE", "PULLED", "SOURCE")]
    rows += [(m.name, m.format, human_size(m.size_bytes), m.pulled_at.replace("T", " ")[:16],
              m.source) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return 0


def show(args: argparse.Namespace) -> int:
    """`localpaged show NAME`: architecture, quantization, context, template."""
    try:
        model = resolve(args.model, pull=False)
    except ModelNotPulledError:
        entry = load_catalog().get(args.model)
        if entry is None:
            raise
        for key, value in (("name", entry.name), ("repo", f"{entry.repo}@{entry.revision}"),
                           ("format", entry.format), ("context length", str(entry.context_length)),
                           ("size", entry.size), ("description", entry.description)):
            print(f"  {key:<15} {value}")
        print(f"  not pulled yet: run `localpaged pull {entry.name}`")
        return 0
    info = model.model_info()
    params = f"{info.parameter_count / 1e6:.0f}M" if info.parameter_count else "unknown"
    lines = [
        ("name", info.name),
        ("path", str(model.path)),
        ("source", model.source),
        ("architecture", info.architecture),
        ("parameters", params),
        ("format", info.format),
        ("quantization", info.quantization),
        ("context length", str(info.context_length)),
        ("size", human_size(info.size_bytes)),
    ]
    if info.digest:
        lines.append(("digest", info.digest))
    for key, value in lines:
        print(f"  {key:<15} {value}")
    template = info.chat_template
    print(f"  {'template':<15} " + ("none (the tokenizer has no chat template)" if not template
                                    else ("(override) " if model.chat_template_override else "")
                                    + f"{len(template)} characters:"))
    if template:
        for line in template.splitlines()[:12]:
            print(f"    {line}")
        if len(template.splitlines()) > 12:
            print("    ...")
    return 0


def rm(args: argparse.Namespace) -> int:
    """`localpaged rm NAME`."""
    model = remove(args.model)
    if model.source == "import":
        print(f"unregistered {model.name} (the file {model.full_path} was left in place)")
    else:
        print(f"deleted {model.name} ({human_size(model.size_bytes)})")
    return 0


def import_gguf(args: argparse.Namespace) -> int:
    """`localpaged import FILE.gguf --name NAME`."""
    model = _import_gguf(args.file, args.name)
    print(f"imported {model.full_path} as {model.name} ({human_size(model.size_bytes)})")
    return 0
