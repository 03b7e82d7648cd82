#!/usr/bin/env python3
"""Issue 21, "The house": move src/eyas/ from one flat folder into subpackages by role.

    python relayout.py REPO_ROOT

Run once on a fresh checkout (it refuses a tree that already has the subpackages). It
1. checks that src/eyas/ holds exactly the modules it has a rule for (fails, naming them, when
   main gained or lost a module: add a rule to MOVES / STAY below),
2. `git mv`s the modules into target/ draft/ kernels/ store/ serve/ (each with an __init__.py),
3. rewrites every reference to a moved module: imports (also lazy ones, `from eyas import x`,
   `import eyas.x`), dotted paths in code, strings (monkeypatch targets, logger names,
   entry points), docs, README, pyproject, Makefile, and `eyas/x.py` file paths,
4. moves the few functions/classes whose place made a cycle or an upward import (SYMBOLS),
   adding the imports they need on both sides and redirecting their importers,
5. drops type-checking-only imports of a step's config from layer modules,
6. writes tests/test_layout.py and the opening of docs/architecture.md, then checks: every
   file compiles, and the layout test passes (no import cycle, no upward import).
Every expected piece of text it patches is checked: a miss stops the run with a message.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

# ------------------------------------------------------------------------------------ the rules

# top-level modules that stay: the steps (one per `eyas X`), the CLI, the two base modules
STEPS = ("prepare", "regenerate", "capture", "vocab", "train", "export", "evaluate", "doctor",
         "pipeline", "demo")
STAY = {"__init__", "__main__", "cli", "config", "errors", *STEPS}

# old module -> new module (under eyas.)
MOVES = {
    # target/: the target model and what is read from it
    "models": "target.models", "taps": "target.taps", "capture_forward": "target.capture_forward",
    "chat": "target.chat", "masking": "target.masking", "tiny": "target.tiny",
    "kimi_like": "target.kimi_like", "corpus": "target.corpus",
    # draft/: the EAGLE-3 draft, its formats, TTT, loss, training data and set-up
    "draft": "draft.eagle3", "export_configs": "draft.formats", "ttt": "draft.ttt",
    "ttt_graph": "draft.ttt_graph", "loss": "draft.loss", "replay": "draft.replay",
    "data": "draft.data", "train_setup": "draft.train_setup",
    # kernels/: Triton / CUDA / torch.compile, each beside its torch fallback
    "attention": "kernels.attention", "attention_kernels": "kernels.attention_kernels",
    "band_kernels": "kernels.band_kernels", "fp8": "kernels.fp8", "fp8_kernels": "kernels.fp8_kernels",
    "fused": "kernels.fused", "loss_kernels": "kernels.loss_kernels",
    "norm_kernels": "kernels.norm_kernels", "rope_kernels": "kernels.rope_kernels",
    # store/: the folders steps hand over
    "shards": "store.shards", "shard_writer": "store.shard_writer", "checkpoint": "store.checkpoint",
    "manifest": "store.manifest", "regenerate_output": "store.regenerate_output",
    # serve/: serving a draft and measuring it there
    "vllm_plugin": "serve.vllm_plugin", "openai_server": "serve.openai_server",
    "speculate": "serve.speculate", "eval_report": "serve.eval_report",
    "export_readme": "serve.export_readme",
}

PACKAGES = {
    "target": "the target: load it (HF, hub, GGUF), find its parts, tap aux layers; chats, masks",
    "draft": "the EAGLE-3 draft: model, config, formats, TTT forward, loss, training data, set-up",
    "kernels": "Triton / CUDA kernels and torch.compile fusions, each beside its torch fallback",
    "store": "the folders steps hand over: manifests, shards, checkpoints, splits, vocab files",
    "serve": "serving: the vLLM plugin, OpenAI client/server, speculative decoding, its report",
}

# symbols moved between modules (new module paths): (from, [names], to, new-file docstring or
# None when `to` exists, names the old module re-exports for its importers' sake[, names the
# moved code imports from the old module])
SYMBOLS = [
    ("kernels.fused", ["SwiGLUDown"], "kernels.swiglu",
     "SwiGLUDown: down_proj(silu(gate) * up) as one autograd Function, in bf16 or fp8.\n\n"
     "Apart from eyas.kernels.fused because its fp8 path uses eyas.kernels.fp8, which itself\n"
     "builds on fused (`cuda_compiled`): fused -> fp8 -> fused was a cycle.", [],
     ["_swiglu", "_swiglu_backward"]),
    ("draft.eagle3", ["ROPE_KEYS", "draft_rope_scaling", "_rope_of", "DraftConfig"], "draft.config",
     "DraftConfig: the EAGLE-3 draft's shape, vocab sizes, RoPE and aux layers (HF spelling).\n\n"
     "Apart from the model (eyas.draft.eagle3) so the exported formats (eyas.draft.formats) can\n"
     "map configs without importing the model, and the model can read exported folders.",
     ["DraftConfig", "draft_rope_scaling"]),
    ("export", ["internal_state_dict", "read_vllm_folder", "find_checkpoint", "load_checkpoint"],
     "draft.formats", None,
     ["internal_state_dict", "read_vllm_folder", "find_checkpoint", "load_checkpoint"]),
    ("capture", ["load_split"], "store.prepared",
     "A prepared folder's splits (written by `eyas prepare`), read for capture, online training\n"
     "and eval.", ["load_split"]),
    ("capture", ["iter_captured_batches", "capture_samples"], "target.capture_forward", None,
     ["iter_captured_batches", "capture_samples"]),
    ("vocab", ["VOCAB_FILE", "check_vocab", "load_vocab"], "store.vocab",
     "A draft vocabulary folder (written by `eyas vocab`): d2t / t2d, checked and read.",
     ["VOCAB_FILE", "check_vocab", "load_vocab"]),
    ("prepare", ["parse_template_kwargs"], "target.chat", None, ["parse_template_kwargs"]),
]

# text patches after the moves: (file, old, new, required)
PATCHES = [
    ("src/eyas/target/kimi_like.py", 'ASSETS = Path(__file__).parent / "assets" / "kimi_like"',
     'ASSETS = Path(__file__).parent.parent / "assets" / "kimi_like"', True),
    ("src/eyas/kernels/fused.py",
     "    SwiGLUDown   down_proj(silu(gate) * up), recomputing the (N, I) product in backward\n",
     "    SwiGLUDown   down_proj(silu(gate) * up), recomputing the (N, I) product in backward\n"
     "                 (in eyas.kernels.swiglu: its fp8 path needs eyas.kernels.fp8)\n", False),
]

TEXT_GLOBS = ["src/**/*.py", "tests/**/*.py", "benchmarks/*.py", "docs/*.md", "README.md",
              "configs/*.md", "pyproject.toml", "Makefile"]

ROOT = Path(".")


def die(msg: str) -> None:
    sys.exit(f"relayout: {msg}")


def git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=True)


# ------------------------------------------------------------------------------- 1. preconditions

def check_tree() -> None:
    pkg = ROOT / "src" / "eyas"
    if not pkg.is_dir():
        die(f"{pkg} not found; run from (or pass) the repository root")
    done = [p for p in PACKAGES if (pkg / p).exists()]
    if done:
        die(f"src/eyas/ already has {done}: this tree is relaid out (run on a fresh copy)")
    dirs = {p.name for p in pkg.iterdir() if p.is_dir() and p.name != "__pycache__"}
    if dirs - {"assets"}:
        die(f"unexpected folders in src/eyas/: {sorted(dirs - {'assets'})}; add a rule")
    have = {p.stem for p in pkg.glob("*.py")}
    want = STAY | set(MOVES)
    missing, new = sorted(want - have), sorted(have - want)
    if missing or new:
        die(f"src/eyas/ changed: missing {missing}, new without a rule {new}; "
            f"edit STAY / MOVES / SYMBOLS in {__file__}")


# --------------------------------------------------------------------------------- 2. git mv

def move_modules() -> None:
    pkg = ROOT / "src" / "eyas"
    for name, doc in PACKAGES.items():
        (pkg / name).mkdir()
        init = pkg / name / "__init__.py"
        init.write_text(f'"""{name}/: {doc}."""\n')
    for old, new in MOVES.items():
        git("mv", f"src/eyas/{old}.py", f"src/eyas/{new.replace('.', '/')}.py")
    git("add", *[f"src/eyas/{name}/__init__.py" for name in PACKAGES])


# ------------------------------------------------------------------------- 3. rewrite references

_MOD_RE = re.compile(r"(?<![\w.])eyas\.(" + "|".join(sorted(MOVES, key=len, reverse=True))
                     + r")(?![\w])")
_PATH_RE = re.compile(r"(?<![\w.])((?:src/)?eyas/)(" + "|".join(sorted(MOVES, key=len, reverse=True))
                      + r")\.py\b")
_BARE_RE = re.compile(r"(?<![\w/.])(" + "|".join(sorted(MOVES, key=len, reverse=True))
                      + r")\.py\b")


def _realign(old: str, new: str) -> str:
    """Keep the continuation lines of a wrapped `from eyas.x import (a,\n b)` under its "("
    when the module's name grew."""
    olds, news = old.split("\n"), new.split("\n")
    if len(olds) != len(news):
        return new
    out, shift = [], 0
    for o, n in zip(olds, news):
        if shift and n.startswith(" " * 8) and n.strip():
            n = " " * shift + n if shift > 0 else n[-shift:]
        else:
            shift = 0
        out.append(n)
        if n.lstrip().startswith("from eyas") and "import (" in n and ")" not in n.split("#")[0]:
            shift = len(n.split("#")[0].rstrip()) - len(o.split("#")[0].rstrip())
    return "\n".join(out)


def rewrite_text(text: str, bare_paths: bool) -> str:
    text = _realign(text, _MOD_RE.sub(lambda m: "eyas." + MOVES[m.group(1)], text))
    text = _PATH_RE.sub(lambda m: m.group(1) + MOVES[m.group(2)].replace(".", "/") + ".py", text)
    if bare_paths:
        text = _BARE_RE.sub(lambda m: MOVES[m.group(1)].replace(".", "/") + ".py", text)
    for src, names, dst, *_ in SYMBOLS:
        for n in names:
            text = re.sub(rf"(?<![\w.])eyas\.{re.escape(src)}\.{re.escape(n)}(?!\w)",
                          f"eyas.{dst}.{n}", text)
    return text


def _symbol_home() -> dict[tuple[str, str], str]:
    return {(f"eyas.{src}", n): f"eyas.{dst}" for src, names, dst, *_ in SYMBOLS for n in names}


def _format_import(indent: str, module: str, names: list[str], comment: str) -> str:
    line = f"{indent}from {module} import {', '.join(names)}{comment}"
    if len(line) <= 100:
        return line
    out, cur = [], f"{indent}from {module} import ("
    for i, n in enumerate(names):
        piece = n + (", " if i < len(names) - 1 else ")")
        if len(cur) + len(piece) > 100:
            out.append(cur.rstrip())
            cur = " " * len(f"{indent}from {module} import (")
        cur += piece
    out.append(cur + comment)
    return "\n".join(out)


def _regroup(mod: str, aliases) -> dict[str, list[str]] | None:
    """The new import groups of `from mod import aliases`, or None when nothing in it moved."""
    homes = _symbol_home()
    if mod == "eyas":
        if not any(a.name in MOVES for a in aliases):
            return None
    elif not any((mod, a.name) in homes for a in aliases):
        return None
    groups: dict[str, list[str]] = {}
    for a in aliases:
        if mod == "eyas" and a.name in MOVES:
            parent, leaf = ("eyas." + MOVES[a.name]).rsplit(".", 1)
            alias = a.asname or (a.name if leaf != a.name else None)
            groups.setdefault(parent, []).append(leaf + (f" as {alias}" if alias else ""))
        else:
            target = homes.get((mod, a.name), mod)
            groups.setdefault(target, []).append(a.name + (f" as {a.asname}" if a.asname else ""))
    return groups


def _render(indent: str, groups: dict[str, list[str]], tail: str) -> str:
    return "\n".join(_format_import(indent, m, ns, tail if i == len(groups) - 1 else "")
                     for i, (m, ns) in enumerate(groups.items()))


def rewrite_imports(text: str, where: str) -> str:
    """`from eyas import <moved module>` and `from <module> import <moved symbol>`, anywhere
    (lazy imports too), regrouped by their new homes. Runs after rewrite_text."""
    tree = ast.parse(text)
    lines = text.split("\n")
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        groups = _regroup(node.module, node.names)
        if groups is None:
            continue
        first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
        if first[:node.col_offset].strip():
            die(f"{where}:{node.lineno}: import shares its line with other code; split it by hand")
        tail = last[node.end_col_offset:]
        if tail.strip() and not tail.strip().startswith("#"):
            die(f"{where}:{node.lineno}: code after an import on one line; split it by hand")
        edits.append((node.lineno - 1, node.end_lineno,
                      _render(first[:node.col_offset], groups, tail)))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = new.split("\n")
    return "\n".join(lines)


_LINE_RE = re.compile(r"^([ \t]*)(from eyas[\w.]* import [\w ,]+?)([ \t]*#.*)?$", re.M)


def rewrite_import_lines(text: str) -> str:
    """The same for one-line imports the AST does not see: in strings (scripts tests run in a
    subprocess) and in the docs' code blocks."""
    def sub(m: re.Match) -> str:
        try:
            node = ast.parse(m.group(2)).body[0]
        except SyntaxError:
            return m.group(0)
        groups = _regroup(node.module, node.names)
        return m.group(0) if groups is None else _render(m.group(1), groups, m.group(3) or "")
    return _LINE_RE.sub(sub, text)


def text_files() -> list[Path]:
    files = set()
    for g in TEXT_GLOBS:
        files.update(p for p in ROOT.glob(g) if p.is_file() and "__pycache__" not in p.parts)
    return sorted(files)


def rewrite_all() -> None:
    for path in text_files():
        old = path.read_text()
        new = rewrite_text(old, bare_paths=path.suffix == ".md")
        if path.suffix == ".py":
            new = rewrite_imports(new, str(path))
        new = rewrite_import_lines(new)
        if new != old:
            path.write_text(new)


# ----------------------------------------------------------------------------- 4. symbol moves

def _mod_path(mod: str) -> Path:
    return ROOT / "src" / "eyas" / (mod.replace(".", "/") + ".py")


def _bindings(tree: ast.Module) -> dict[str, ast.stmt]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = node
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                out[a.asname or a.name] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def _names_used(nodes) -> set[str]:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}


def _import_line(node: ast.stmt, name: str) -> str:
    if isinstance(node, ast.Import):
        for a in node.names:
            if (a.asname or a.name.split(".")[0]) == name:
                return f"import {a.name}" + (f" as {a.asname}" if a.asname else "")
    for a in node.names:
        if (a.asname or a.name) == name:
            return f"from {node.module} import {a.name}" + (f" as {a.asname}" if a.asname else "")
    raise AssertionError(name)


def _group(line: str) -> int:
    """0 stdlib, 1 third party, 2 eyas (the order of the repo's import blocks)."""
    top = line.split()[1].split(".")[0]
    return 2 if top == "eyas" else 0 if top in sys.stdlib_module_names or top == "__future__" else 1


def _merge(imports: list[str]) -> list[str]:
    """`from m import a` + `from m import b` -> `from m import a, b`, sorted in each group."""
    froms: dict[str, list[str]] = {}
    plain = []
    for line in dict.fromkeys(imports):
        if line.startswith("from "):
            mod, _, names = line[5:].partition(" import ")
            froms.setdefault(mod, []).extend(n.strip() for n in names.split(","))
        else:
            plain.append(line)
    out = plain + [_format_import("", m, ns, "") for m, ns in froms.items()]
    return sorted(out, key=lambda l: (_group(l), l.split()[0] == "from", l.split()[1]))


def _insert_imports(text: str, imports: list[str]) -> str:
    """Add import lines to the module's top import block, each after the last import of its
    group (stdlib, third party, eyas); a group it lacks is started after the previous one."""
    if not imports:
        return text
    for line in reversed(_merge(imports)):
        tree = ast.parse(text)
        block = []
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                block.append(node)
            elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and not block:
                continue
            else:
                break
        lines = text.split("\n")
        g = _group(line)
        same = [n for n in block if _group(ast.get_source_segment(text, n)) == g]
        before = [n for n in block if _group(ast.get_source_segment(text, n)) < g]
        if same:
            at, new = same[-1].end_lineno, line.split("\n")
        elif before:
            at, new = before[-1].end_lineno, [""] + line.split("\n")
        elif block:
            at, new = block[0].lineno - 1, line.split("\n") + [""]
        else:
            doc = tree.body[0].end_lineno if tree.body and isinstance(tree.body[0], ast.Expr) else 0
            at, new = doc, [""] + line.split("\n")
        lines[at:at] = new
        text = "\n".join(lines)
    return text


def _is_step(module: str) -> bool:
    return module.startswith("eyas.") and module[5:] in STEPS


def move_symbols(src: str, names: list[str], dst: str, doc: str | None, reexport: list[str],
                 uses: list[str]) -> None:
    spath, dpath = _mod_path(src), _mod_path(dst)
    text = spath.read_text()
    tree = ast.parse(text)
    binds = _bindings(tree)
    nodes = []
    for n in names:
        node = binds.get(n)
        if node is None or isinstance(node, (ast.Import, ast.ImportFrom)):
            die(f"{spath}: expected a top-level definition of {n} to move to eyas.{dst}")
        nodes.append(node)
    lines = text.split("\n")
    spans = []
    for node in nodes:
        start = (node.decorator_list[0].lineno if getattr(node, "decorator_list", None)
                 else node.lineno) - 1
        while start > 0 and lines[start - 1].startswith("#"):
            start -= 1  # the comment block right above belongs to it
        spans.append((start, node.end_lineno))
    chunk = "\n\n\n".join("\n".join(lines[a:b]) for a, b in sorted(spans))
    # what the moved code needs from its old module
    need, dst_imports, want_log = _names_used(nodes) - set(names), [], False
    for n in sorted(need):
        node = binds.get(n)
        if node is None:
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.module == f"eyas.{dst}":
                continue  # defined where the code goes
            line = _import_line(node, n)
            if isinstance(node, ast.ImportFrom) and _is_step(node.module):
                die(f"moving {names} to eyas.{dst}: they import {n} from the step {node.module}")
            dst_imports.append(line)
        elif n == "log":
            want_log = True
        elif n in uses:
            dst_imports.append(f"from eyas.{src} import {n}")
        else:
            die(f"moving {names} from eyas.{src} to eyas.{dst}: they use {n}, defined in "
                f"eyas.{src}; add it to the move")
    # cut from the old module, then import back what it still uses (and the re-exports)
    for a, b in sorted(spans, reverse=True):
        del lines[a:b]
        while a < len(lines) and a > 0 and not lines[a].strip() and not lines[a - 1].strip():
            del lines[a]
    rest = "\n".join(lines)
    rest_tree = ast.parse(rest)
    still = sorted((_names_used([rest_tree]) & set(names)) | set(reexport))
    if still:
        ordered = [n for n in names if n in still]
        rest = _insert_imports(rest, [f"from eyas.{dst} import {', '.join(ordered)}"])
    spath.write_text(rest)
    # paste into the new module
    if doc is not None:
        if dpath.exists():
            die(f"{dpath} exists already; SYMBOLS expects to create it")
        body = f'"""{doc}\n"""\n\nfrom __future__ import annotations\n'
    else:
        if not dpath.exists():
            die(f"{dpath} not found; SYMBOLS expects to add to it")
        body = dpath.read_text().rstrip("\n") + "\n"
    have = _bindings(ast.parse(body))
    add = [line for line in dict.fromkeys(dst_imports) if line.split()[-1] not in have]
    if want_log and "log" not in have and "logging" not in have:
        add.insert(0, "import logging")
    body = _insert_imports(body, [line for line in add if line.startswith(("import", "from"))])
    if want_log and "log" not in have:
        body = body.rstrip("\n") + "\n\nlog = logging.getLogger(__name__)\n"
    dpath.write_text(body.rstrip("\n") + "\n\n\n" + chunk.strip("\n") + "\n")
    if doc is not None:
        git("add", str(dpath.relative_to(ROOT)))


# ------------------------------------------------------------- 5. type-only imports of steps

def drop_type_only_step_imports() -> None:
    """A layer module annotating with a step's config (`cfg: TrainConfig`) imported it under
    TYPE_CHECKING: an upward import. The annotations stay (never evaluated: every module has
    `from __future__ import annotations`); the import goes, replaced by a comment."""
    for path in sorted((ROOT / "src" / "eyas").glob("*/*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        lines = text.split("\n")
        edits = []
        for node in tree.body:
            if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                    and node.test.id == "TYPE_CHECKING"):
                continue
            imps = [b for b in node.body if isinstance(b, ast.ImportFrom)]
            if len(imps) != len(node.body) or not all(_is_step(b.module) for b in imps):
                continue
            if "from __future__ import annotations" not in text:
                die(f"{path}: annotations would be evaluated without the TYPE_CHECKING import")
            notes = [f"# {', '.join(a.name for a in b.names)}: from the step {b.module}, named in "
                     f"annotations only (a layer never imports a step)" for b in imps]
            edits.append((node.lineno - 1, node.end_lineno, notes))
        if not edits:
            continue
        for a, b, new in sorted(edits, reverse=True):
            lines[a:b] = new
        text = "\n".join(lines)
        if not re.search(r"\bTYPE_CHECKING\b(?!,| ?\n|\))", text.split("from typing import", 1)[-1]
                         .split("\n", 1)[-1]) and "TYPE_CHECKING" not in text.split("\n", 1)[-1] \
                .replace("from typing import TYPE_CHECKING", "").replace("TYPE_CHECKING, ", ""):
            text = text.replace("from typing import TYPE_CHECKING\n", "")
            text = text.replace("from typing import TYPE_CHECKING, ", "from typing import ")
        path.write_text(text)


def apply_patches() -> None:
    for rel, old, new, required in PATCHES:
        path = ROOT / rel
        text = path.read_text()
        if old not in text:
            if required:
                die(f"{rel}: expected text not found: {old!r}")
            print(f"relayout: note: {rel}: optional patch not applied ({old[:50]!r}...)")
            continue
        path.write_text(text.replace(old, new, 1))


# --------------------------------------------------------------------- 6. docs and the test

ARCH_OPENING = """\
## Layout

Folders by role: the steps at the top, the layers they stand on below. Imports point down
only (steps -> layers, never a layer -> a step, never a circle; tests/test_layout.py checks
it), and steps reach each other only through the folders they write (manifests).

    src/eyas/
      cli.py          one table: subcommand -> (step function, config class)
      prepare.py regenerate.py capture.py vocab.py train.py export.py evaluate.py
      doctor.py pipeline.py demo.py     one module per `eyas X` (pipeline.py: `eyas run`)
      config.py errors.py               config dataclasses -> CLI flags; EyasError
      target/         {target}
      draft/          {draft}
      kernels/        {kernels}
      store/          {store}
      serve/          {serve}
      assets/         files of the built-in tiny targets (package data)

Layers may use: kernels/ and store/ nothing else of eyas (but config, errors); target/ store/;
draft/ kernels/ store/ target/; serve/ all four. What each step imports:

{steps}

"""


def step_imports() -> str:
    out = []
    for step in STEPS:
        tree = ast.parse((ROOT / "src" / "eyas" / f"{step}.py").read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eyas"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if _mod_path(full[5:]).is_file():
                        deps.add(full[5:])
                    elif node.module != "eyas":
                        deps.add(node.module[5:])
            elif isinstance(node, ast.Import):
                deps.update(a.name[5:] for a in node.names if a.name.startswith("eyas."))
        layer = sorted(d for d in deps if "." in d)
        flat = sorted(d for d in deps if "." not in d)
        out.append(textwrap.fill(f"- `{step}`: " + ", ".join(layer + flat), 96,
                                 subsequent_indent="  ", break_on_hyphens=False))
    return "\n".join(out)


def write_docs() -> None:
    path = ROOT / "docs" / "architecture.md"
    text = path.read_text()
    title, _, rest = text.partition("\n")
    if not title.startswith("# "):
        die(f"{path}: expected a '# ' title on its first line")
    opening = ARCH_OPENING.format(**PACKAGES, steps=step_imports())
    path.write_text(title + "\n\n" + opening + rest.lstrip("\n"))


LAYOUT_TEST = Path(__file__).with_name("test_layout.py")


def write_test() -> None:
    (ROOT / "tests" / "test_layout.py").write_text(LAYOUT_TEST.read_text())
    git("add", "tests/test_layout.py")


def verify() -> None:
    bad = []
    for path in text_files():
        if path.suffix == ".py":
            try:
                compile(path.read_text(), str(path), "exec")
            except SyntaxError as err:
                bad.append(f"{path}: {err}")
    if bad:
        die("files no longer compile:\n" + "\n".join(bad))
    left = []
    for path in text_files():
        text = path.read_text()
        for m in _LINE_RE.finditer(text):
            try:
                node = ast.parse(m.group(2)).body[0]
            except SyntaxError:
                continue
            if node.module == "eyas" and any(a.name in MOVES for a in node.names):
                left.append(f"{path}: {m.group(0).strip()}")
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and node.module == "eyas" and not node.level \
                        and any(a.name in MOVES for a in node.names):
                    left.append(f"{path}:{node.lineno}: from eyas import {node.names[0].name}...")
    if left:
        die("imports of moved modules left:\n" + "\n".join(left))
    run = subprocess.run([sys.executable, "tests/test_layout.py"], cwd=ROOT,
                         capture_output=True, text=True)
    print(run.stdout, end="")
    if run.returncode:
        die("the layout check fails:\n" + run.stdout + run.stderr)


def main() -> None:
    global ROOT
    ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    check_tree()
    move_modules()
    rewrite_all()
    for src, names, dst, doc, reexport, *uses in SYMBOLS:
        move_symbols(src, names, dst, doc, reexport, uses[0] if uses else [])
    drop_type_only_step_imports()
    apply_patches()
    write_docs()
    write_test()
    verify()
    print("relayout: done; review with `git status` and `git diff --stat -M`")


if __name__ == "__main__":
    main()
