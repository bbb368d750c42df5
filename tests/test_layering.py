"""The code reads from the bottom up: no import circle, small files, node data with owners.

These tests read the sources, not the running code: the `use` lines and inline paths of
every Rust file under rust/, the `import` statements of every Python file under python/.
They protect the layering that docs/design.md's map ("How the code is layered") describes:

- no module imports another that imports it back, directly or through others;
- no library file of the core over 800 lines, no component file over 700;
- the Mamba component's node fields are touched only by the Mamba component and by the
  modules that tally, evict, report and audit every component's data.

A name is attributed to the file that defines it, following the lines that hand names on
(`pub use` in a folder's `mod.rs` or the crate's `lib.rs`, a package's ``__init__.py``):
such a line is no import by itself. In Rust, an import is a `use` line or a path from
`crate::`, `super::` or `self::`; a folder's `mod.rs` naming its own submodules' items by
their relative path (`host::Backup`) composes its parts and imports nothing.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import TypeGuard

ROOT = Path(__file__).resolve().parent.parent
CRATES = [ROOT / "rust" / d / "src" for d in ("core", "l3", "py")]
CORE = ROOT / "rust" / "core" / "src"
PACKAGE = ROOT / "python" / "radixcache"


# --------------------------------------------------------------------------- Rust


def _strip_rust(text: str) -> str:
    """The code without comments, string and char literals (replaced by blanks)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i : i + 10]) and not _ident_before(text, i):
            hashes = re.match(r"r(#*)\"", text[i:])
            assert hashes is not None
            end = '"' + hashes.group(1)
            j = text.find(end, i + len(hashes.group(0)))
            i = n if j < 0 else j + len(end)
            out.append('""')
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            out.append('""')
        elif c == "'" and re.match(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'", text[i:]):
            m = re.match(r"'(\\.|[^\\'])'|'\\u\{[0-9a-fA-F]+\}'", text[i:])
            assert m is not None
            i += len(m.group(0))
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _ident_before(text: str, i: int) -> bool:
    return i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")


def _drop_test_modules(code: str) -> str:
    """The code without `#[cfg(test)]` items (inline test modules, test-only functions)."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*", code)
        if m is None:
            return code
        start, j = m.start(), m.end()
        # The item runs to its first `;` at depth 0 or to the end of its first `{...}`.
        depth = 0
        while j < len(code):
            ch = code[j]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    j += 1
                    break
            elif ch == ";" and depth == 0:
                j += 1
                break
            j += 1
        code = code[:start] + code[j:]


@dataclass
class RustFile:
    path: Path
    module: tuple[str, ...]  # its module path inside the crate
    code: str = ""
    defines: set[str] = field(default_factory=set)
    # name -> the path it is handed on from (`pub use a::b::Name`), relative to this module
    reexports: dict[str, list[str]] = field(default_factory=dict)
    globs: list[list[str]] = field(default_factory=list)  # `pub use a::b::*`
    uses: list[tuple[list[str], bool]] = field(default_factory=list)  # (path, counted)


def _is_test_file(path: Path, src: Path) -> bool:
    rel = path.relative_to(src).parts
    return (
        "tests" in rel[:-1]
        or rel[-1] in ("tests.rs", "test_util.rs")
        or rel[-1].endswith("_tests.rs")
    )


def _module_of(path: Path, src: Path) -> tuple[str, ...]:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts.pop()
    return tuple(parts)


def _expand_use(tree: str) -> Iterator[tuple[list[str], str | None]]:
    """The paths of one use tree (`a::{b::C, d as e, f::*}`), each with its alias."""
    tree = re.sub(r"\s*([{},]|::)\s*", r"\1", re.sub(r"\s+", " ", tree.strip()))

    def split_top(s: str) -> list[str]:
        parts, depth, cur = [], 0, ""
        for ch in s:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        if cur:
            parts.append(cur)
        return parts

    def walk(prefix: list[str], s: str) -> Iterator[tuple[list[str], str | None]]:
        brace = s.find("{")
        if brace >= 0 and s.endswith("}"):
            head = [p for p in s[:brace].split("::") if p]
            for part in split_top(s[brace + 1 : -1]):
                yield from walk(prefix + head, part)
            return
        alias = None
        if " as " in s:
            s, alias = s.split(" as ", 1)
        yield prefix + [p for p in s.split("::") if p], alias

    yield from walk([], tree)


USE_RE = re.compile(r"(?m)^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);")
DEF_RE = re.compile(
    r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+|const\s+|async\s+)*"
    r"(?:struct|enum|fn|trait|type|const|static|union|mod)\s+([A-Za-z_][A-Za-z0-9_]*)"
)
MACRO_RE = re.compile(r"macro_rules!\s*([A-Za-z_][A-Za-z0-9_]*)")
PATH_RE = re.compile(r"(?<![A-Za-z0-9_:$])((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")


def _read_crate(src: Path) -> dict[tuple[str, ...], RustFile]:
    files: dict[tuple[str, ...], RustFile] = {}
    for path in sorted(src.rglob("*.rs")):
        if _is_test_file(path, src):
            continue
        f = RustFile(path, _module_of(path, src))
        code = _drop_test_modules(_strip_rust(path.read_text()))
        f.defines = set(DEF_RE.findall(code)) | set(MACRO_RE.findall(code))
        body = code
        for m in USE_RE.finditer(code):
            public = m.group(1) is not None
            for p, alias in _expand_use(m.group(2)):
                name = alias or p[-1]
                if public and p[-1] == "*":
                    f.globs.append(p[:-1])
                elif public:
                    f.reexports[name] = p
                f.uses.append((p, not public))
            body = body.replace(m.group(0), " ")
        for m in PATH_RE.finditer(body):
            f.uses.append((m.group(1).split("::"), True))
        f.code = body
        files[f.module] = f
    return files


def _resolve(
    files: dict[tuple[str, ...], RustFile],
    here: tuple[str, ...],
    path: list[str],
    depth: int = 0,
) -> Path | None:
    """The file that defines what `path` (seen from module `here`) names, if in the crate."""
    if depth > 20 or not path:
        return None
    head, rest = path[0], path[1:]
    if head == "crate":
        mod: tuple[str, ...] = ()
    elif head == "super":
        mod = here[:-1]
    elif head == "self":
        mod = here
    elif (*here, head) in files:  # a child module named without `self::`
        mod, rest = (*here, head), rest
        return _resolve_in(files, mod, rest, depth)
    else:
        return None  # another crate or the standard library
    while rest and rest[0] == "super":
        mod, rest = mod[:-1], rest[1:]
    return _resolve_in(files, mod, rest, depth)


def _resolve_in(
    files: dict[tuple[str, ...], RustFile], mod: tuple[str, ...], rest: list[str], depth: int
) -> Path | None:
    while rest and (*mod, rest[0]) in files:
        mod, rest = (*mod, rest[0]), rest[1:]
    f = files.get(mod)
    if f is None:
        return None
    if not rest or rest[0] in ("*", "self") or rest[0] in f.defines:
        return f.path
    name = rest[0]
    if name in f.reexports:
        target = f.reexports[name]
        return _resolve(files, mod, [*target[:-1], target[-1], *rest[1:]], depth + 1) or f.path
    for glob in f.globs:
        found = _resolve(files, mod, [*glob, *rest], depth + 1)
        if found is not None and found != f.path:
            return found
    return f.path


def rust_edges(src: Path) -> dict[Path, dict[Path, set[str]]]:
    """file -> {file it imports: the names taken}, for one crate's library files."""
    files = _read_crate(src)
    edges: dict[Path, dict[Path, set[str]]] = {f.path: {} for f in files.values()}
    for f in files.values():
        for p, counted in f.uses:
            if not counted:
                continue
            target = _resolve(files, f.module, p)
            if target is not None and target != f.path:
                edges[f.path].setdefault(target, set()).add("::".join(p))
    return edges


# ------------------------------------------------------------------------- Python


def _py_module_of(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_edges(package: Path = PACKAGE) -> dict[Path, dict[Path, set[str]]]:
    """file -> {file it imports: the names taken}, imports inside functions included."""
    paths = {_py_module_of(p, package): p for p in sorted(package.rglob("*.py"))}
    trees = {mod: ast.parse(p.read_text()) for mod, p in paths.items()}
    extensions = {_py_module_of(p, package) for p in package.rglob("*.pyi")} - set(paths)

    def defines(mod: str) -> set[str]:
        names = set()
        for node in trees[mod].body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
        return names

    def imported(mod: str) -> dict[str, tuple[str, str | None]]:
        """The names a module imports at its top level: name -> (module, attribute)."""
        out: dict[str, tuple[str, str | None]] = {}
        for node in trees[mod].body:
            if isinstance(node, ast.ImportFrom):
                base = _absolute(mod, node, package)
                for a in node.names:
                    out[a.asname or a.name] = (base, a.name)
        return out

    def owner(mod: str, name: str | None, seen: int = 0) -> str | None:
        """The module that defines `name` of `mod` (or `mod` itself, for no name)."""
        if name is not None and f"{mod}.{name}" in paths:
            return f"{mod}.{name}"
        if name is not None and f"{mod}.{name}" in extensions:
            return None  # the compiled extension: it imports nothing of the package
        if mod not in paths:
            return None
        if name is None or name in defines(mod) or seen > 10:
            return mod
        handed = imported(mod).get(name)
        if handed is not None:
            return owner(handed[0], handed[1], seen + 1) or mod
        return mod

    edges: dict[Path, dict[Path, set[str]]] = {p: {} for p in paths.values()}
    for mod, tree in trees.items():
        is_package = paths[mod].name == "__init__.py"
        own_names = _names_used(tree)
        face = set(tree.body) | {
            stmt for node in tree.body if _is_type_checking(node) for stmt in node.body
        }
        for node in ast.walk(tree):
            targets: list[tuple[str, str | None, str]] = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None, a.asname or a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(mod, node, package)
                targets = [(base, a.name, a.asname or a.name) for a in node.names]
            for target_mod, name, bound in targets:
                if is_package and node in face and bound not in own_names:
                    continue  # handed on by a package's face, not used there
                where = owner(target_mod, name)
                if where is not None and where != mod:
                    label = f"{target_mod}.{name}" if name else target_mod
                    edges[paths[mod]].setdefault(paths[where], set()).add(label)
    return edges


def _is_type_checking(node: ast.stmt) -> TypeGuard[ast.If]:
    """An `if TYPE_CHECKING:` block: the names a type checker sees, imported by nobody."""
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def _absolute(mod: str, node: ast.ImportFrom, package: Path) -> str:
    if not node.level:
        return node.module or ""
    parts = mod.split(".")
    is_package = (package.parent / Path(*parts) / "__init__.py").exists()
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _names_used(tree: ast.Module) -> set[str]:
    """Names the module's own code uses (outside its top-level imports and `__all__`)."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            root = node
            while isinstance(root, ast.Attribute):
                root = root.value  # type: ignore[assignment]
            if isinstance(root, ast.Name):
                used.add(root.id)
    return used - {"__all__"}


# -------------------------------------------------------------------------- graph


def circles(edges: dict[Path, dict[Path, set[str]]]) -> list[list[Path]]:
    """The strongly connected groups of more than one file (Tarjan's algorithm)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on: set[Path] = set()
    found: list[list[Path]] = []

    def visit(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def describe(edges: dict[Path, dict[Path, set[str]]], group: Iterable[Path]) -> str:
    members = set(group)
    lines = []
    for a in sorted(members):
        for b, names in sorted(edges[a].items()):
            if b in members:
                lines.append(f"  {_shown(a)} -> {_shown(b)}: {', '.join(sorted(names))}")
    return "\n".join(lines)


# -------------------------------------------------------------------------- tests


def _assert_no_circle(edges: dict[Path, dict[Path, set[str]]]) -> None:
    found = circles(edges)
    report = "\n".join(f"circle of {len(g)} files:\n{describe(edges, g)}" for g in found)
    assert not found, report


def test_no_rust_module_imports_one_that_imports_it_back() -> None:
    for src in CRATES:
        _assert_no_circle(rust_edges(src))


def test_no_python_module_imports_one_that_imports_it_back() -> None:
    _assert_no_circle(python_edges())


def test_the_reader_finds_a_circle_and_names_its_ties(tmp_path: Path) -> None:
    # The check itself can fail: a crate whose two files take names from each other,
    # one of them through a re-export, is reported with the names that tie it.
    src = tmp_path / "src"
    (src / "part").mkdir(parents=True)
    (src / "lib.rs").write_text("mod hashes;\nmod part;\npub use part::Thing;\n")
    (src / "part" / "mod.rs").write_text(
        "mod a;\nmod b;\npub use a::Thing;\n// use b::Other; (a comment is no import)\n"
    )
    (src / "part" / "a.rs").write_text(
        'pub struct Thing;\nfn f() -> crate::part::b::Other { let _ = "super::x"; todo!() }\n'
    )
    (src / "part" / "b.rs").write_text(
        "use crate::{Thing as Base};\nuse crate::hashes::Hash;\npub struct Other(Base, Hash);\n"
    )
    (src / "hashes.rs").write_text("pub struct Hash;\n")
    edges = rust_edges(src)
    (group,) = circles(edges)
    assert [p.name for p in group] == ["a.rs", "b.rs"]
    assert "crate::Thing" in describe(edges, group)
    assert list(edges[src / "part" / "b.rs"]) == [src / "part" / "a.rs", src / "hashes.rs"]
    # A re-export alone draws no arrow: lib.rs and mod.rs take part in no circle.
    assert edges[src / "lib.rs"] == {}
    assert edges[src / "part" / "mod.rs"] == {}


def test_the_python_reader_finds_a_circle_through_a_function_and_a_package_face(
    tmp_path: Path,
) -> None:
    # An import inside a function counts; a package's __init__ that only hands a name on
    # does not, and a name taken through it is attributed to the module defining it.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.sub.b import B\n__all__ = ['B']\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import B\n\nclass A(B): ...\n")
    (pkg / "sub" / "b.py").write_text("class B:\n    def f(self):\n        from pkg import a\n")
    (pkg / "c.py").write_text("from pkg.a import A\n")
    edges = python_edges(pkg)
    (group,) = circles(edges)
    assert [p.name for p in group] == ["a.py", "b.py"]
    assert edges[pkg / "__init__.py"] == {}
    assert list(edges[pkg / "c.py"]) == [pkg / "a.py"]


def test_no_core_library_file_is_over_800_lines_and_no_component_over_700() -> None:
    too_long = []
    for path in sorted(CORE.rglob("*.rs")):
        if _is_test_file(path, CORE):
            continue
        lines = len(path.read_text().splitlines())
        limit = 700 if path.parent.name == "components" else 800
        if lines > limit:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines (limit {limit})")
    assert not too_long, "\n".join(too_long)


def _mamba_fields() -> list[str]:
    for path in CORE.rglob("*.rs"):
        m = re.search(r"struct MambaNode\s*\{(.*?)\n\}", path.read_text(), re.S)
        if m:
            return re.findall(r"(?m)^\s*pub(?:\([^)]*\))?\s+([a-z_][a-z0-9_]*)\s*:", m.group(1))
    raise AssertionError("no struct MambaNode under rust/core/src")


# Who may read or write a node's Mamba data: the component itself, and the modules that
# tally (sizes), order (eviction), report and audit every component's node data.
MAMBA_FIELD_READERS = (
    "cache/components/mamba.rs",
    "cache/sizes.rs",
    "cache/eviction/",
    "cache/report.rs",
    "audit.rs",
)


def test_mamba_node_fields_are_touched_only_by_their_owners() -> None:
    fields = _mamba_fields()
    assert {"device", "host", "lock"} <= set(fields)
    touch = re.compile(rf"\bmamba\s*\.\s*({'|'.join(fields)})\b")
    outside = []
    for path in sorted(CORE.rglob("*.rs")):
        rel = path.relative_to(CORE).as_posix()
        if _is_test_file(path, CORE) or rel.startswith(MAMBA_FIELD_READERS):
            continue
        code = _drop_test_modules(_strip_rust(path.read_text()))
        for m in touch.finditer(code):
            line = code.count("\n", 0, m.start()) + 1
            outside.append(f"rust/core/src/{rel}:{line}: {m.group(0)}")
    assert not outside, "\n".join(outside)
