"""MkDocs hooks of tigon's docs site (registered in mkdocs.yml under ``hooks:``).

- The model support matrix of ``models.md`` is generated from the families table,
  ``tigon.transformers.families.FAMILIES``, at every build: the marker line
  ``<!-- families-matrix -->`` becomes one row per family, so the page cannot drift from the code.
- The headline shapes of ``anchors.md`` are generated from ``tigon.bench.specs.OPS`` (the marker
  ``<!-- headline-shapes -->``): the shapes `tigon bench` marks and `tigon bench --quick` runs.
- A link from a page to a file of the repository outside ``docs/`` (a perf note's link to
  ``../../benchmarks/results/...``) works where the Markdown is read on its own, but has no page
  on the site: it becomes the link's text and the file's path in the repository, as code.
- The docstrings use Sphinx roles (``:func:`rms_norm```), which Markdown renders as the role's
  name followed by code; they become optional cross-references (a link where the object is
  documented on the site, plain code where it is not, never a warning). A paragraph ending in
  reStructuredText's ``::`` before a literal block ends in ``:``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

MATRIX_MARKER = "<!-- families-matrix -->"
FAMILIES_FILE = Path(__file__).resolve().parent.parent / "src" / "tigon" / "transformers" / "families.py"

# What each rotary form of the table computes (tigon.transformers.layers.ROPE_FORMS); a form
# missing here is shown by its key.
ROPE_FORMS = {
    "rotate_half": "rotate-half pairs",
    "single": "rotate-half, q and k in separate calls",
    "half_table": "rotate-half, half-width tables",
    "complex_bhtd": "complex (interleaved) pairs",
    "complex_bthd": "complex pairs, [B, T, H, D] layout",
    "deepseek_interleave": "interleaved pairs, half-split output",
    "glm": "interleaved pairs of the first half",
    "glm4v": "interleaved pairs, one table entry per feature",
    "deepseek_v4": "interleaved pairs of the last features",
}
GATES = {"swiglu": "SwiGLU", "geglu": "GeGLU", "relu2": "squared ReLU", "swiglu_clamped": "clamped SwiGLU"}
LAYOUTS = {
    "separate": "",
    "gate_up": ", one gate_up projection",
    "up_down": ", no gate",
    "experts": ", the experts' gate",
}


def load_families() -> dict:
    """The families table, loaded from its file alone: it is plain data (dataclasses), so the
    build needs neither torch nor transformers to be imported."""
    spec = importlib.util.spec_from_file_location("_tigon_families_for_docs", FAMILIES_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module.FAMILIES


def _kind(family) -> str:
    if family.head is None:
        return "vision tower"
    moe = " (MoE)" if family.experts else ""
    if family.head.endswith("ForConditionalGeneration"):
        return f"vision-language{moe}"
    return f"text{moe}"


def _norm(norm) -> str:
    kernel = {"rms": "RMSNorm", "rms_gated": "gated RMSNorm", "layer": "LayerNorm"}.get(norm.kind, norm.kind)
    details = []
    if norm.offset:
        details.append(f"{norm.offset:g} + weight")
    if norm.kind != "layer" and norm.casting != "llama":
        details.append("scaled in fp32")  # Gemma's casting: the weight applied before rounding
    return kernel + (f" ({', '.join(details)})" if details else "")


def _mlp(mlp) -> str:
    return GATES.get(mlp.gate, mlp.gate) + LAYOUTS.get(mlp.layout, f", {mlp.layout}")


def _head(family) -> str:
    if family.head is None:
        return "— (a vision tower)"
    settings = [
        (family.logit_softcap, "softcap"),
        (family.logit_divisor, "logits ÷"),
        (family.logit_multiplier, "logits ×"),
        (family.aux_loss_coef, "+ router loss"),
    ]
    extras = [f"{what} `{field}`" for field, what in settings if field]
    return "fused linear CE" + "".join(f"; {extra}" for extra in extras)


def _cell(items) -> str:
    unique = list(dict.fromkeys(items))  # several classes may share one kernel variant
    return "<br>".join(unique) if unique else "—"


def families_matrix(families: dict) -> str:
    """The support matrix as Markdown: which kernel computes each kind of layer of each family,
    then which classes and functions of its modeling module each row replaces."""
    kernels = [
        "| model type | kind | norms | RoPE | MLP | MoE experts | loss with labels |",
        "|---|---|---|---|---|---|---|",
    ]
    replaced = [
        "| model type | modeling module | replaced | loss head | layer flags |",
        "|---|---|---|---|---|",
    ]
    for model_type, family in families.items():
        cells = [
            f"`{model_type}`",
            _kind(family),
            _cell([_norm(norm) for norm in family.norms]),
            _cell([ROPE_FORMS.get(rope.form, rope.form) for rope in family.ropes]),
            _cell([_mlp(mlp) for mlp in family.mlps]),
            "fused MoE" if family.experts else "—",
            _head(family),
        ]
        kernels.append("| " + " | ".join(cells) + " |")
        names = list(dict.fromkeys(row.name for row in family.sub_rows()))
        flags = sorted({row.flag for row in family.sub_rows()})
        cells = [
            f"`{model_type}`",
            f"`{family.module.removeprefix('transformers.models.')}`",
            ", ".join(f"`{name}`" for name in names) or "—",
            f"`{family.head}`" if family.head else "—",
            ", ".join(f"`{flag}`" for flag in flags) or "—",
        ]
        replaced.append("| " + " | ".join(cells) + " |")
    return "\n".join(
        [*kernels, "", "## What each row replaces", "", MODULE_NOTE, "", *replaced]
    )


MODULE_NOTE = (
    "The modeling module is under `transformers.models`. The layer flags are the patcher's flags "
    "that change a layer of the family."
)


GENERIC_LINK_TEXTS = {"csv", "json", "plot", "results", "log"}
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def _repository_links(markdown: str, page, docs_dir: Path) -> str:
    root = docs_dir.parent
    page_dir = (docs_dir / page.file.src_path).parent

    def replace(match: re.Match) -> str:
        text, target = match.groups()
        if re.match(r"[a-z]+:|#|/", target):
            return match.group(0)
        path = (page_dir / target.split("#")[0]).resolve()
        if path.is_relative_to(docs_dir) or not path.is_relative_to(root):
            return match.group(0)
        shown = path.relative_to(root).as_posix() + ("/" if target.endswith("/") else "")
        # "([csv](...))" reads as "(`benchmarks/.../x.csv`)": the path says what the word said.
        return f"`{shown}`" if text in GENERIC_LINK_TEXTS else f"{text} (`{shown}`)"

    return _LINK.sub(replace, markdown)


HEADLINE_MARKER = "<!-- headline-shapes -->"


def headline_shapes() -> str:
    """One row per op of ``tigon bench``: its headline shape, the swept dimension and what its
    floor counts. Imports tigon (and so torch): the specs build their inputs with torch."""
    from tigon.bench.specs import OPS

    lines = ["| op | headline shape | swept | floor counts |", "|---|---|---|---|"]
    for name, spec in OPS.items():
        sweep = spec.sweep
        shape = spec.describe(sweep.shape_dims(sweep.headline))
        sizes = ", ".join(str(size) for size in sweep.sizes)
        lines.append(f"| `{name}` | {shape} | {sweep.axis} ∈ {{{sizes}}} | {spec.unit} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _repository_links(markdown, page, Path(config["docs_dir"]).resolve())
    if MATRIX_MARKER in markdown:
        families = load_families()
        summary = f"{len(families)} rows, generated from `tigon.transformers.families.FAMILIES` at build time.\n\n"
        markdown = markdown.replace(MATRIX_MARKER, summary + families_matrix(families))
    if HEADLINE_MARKER in markdown:
        markdown = markdown.replace(HEADLINE_MARKER, headline_shapes())
    return markdown


# ``:func:`name``` as Markdown renders it: the role, then the code span.
_ROLE = re.compile(r":(?:func|meth|class|mod|data|attr|obj|exc):<code>(~?)([\w.]+)</code>")
_OBJECT_ID = re.compile(r'id="(tigon(?:\.\w+)*)"')


def on_page_content(html: str, page, config, files) -> str:
    # An unqualified name is taken relative to the page's first documented module (api/nn.md's
    # ``tigon.nn``): where that misses, the reference is optional and renders as code.
    first = _OBJECT_ID.search(html)
    module = first.group(1) if first else ""

    def reference(match: re.Match) -> str:
        short, target = match.group(1), match.group(2)
        identifier = target if target.startswith(("tigon.", "torch.")) or not module else f"{module}.{target}"
        shown = target.rsplit(".", 1)[-1] if short else target
        return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'

    # reStructuredText's "text::" before a literal block: Markdown already made the block code.
    return _ROLE.sub(reference, html).replace("::</p>", ":</p>")
