"""The house keeps itself: molt/ imports in layers (no cycle between modules or between sub-packages, function-local
imports included) and stays within its code budget (ARCHITECTURE.md: 8,600 lines; blank, comment and docstring
lines are not counted)."""
import ast
import io
import tokenize
from pathlib import Path

MOLT = Path(__file__).resolve().parents[1] / "molt"
BUDGET = 8_600
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}


def sources() -> dict[str, str]:
    """module name -> source of every file under molt/ (a package is its __init__.py)."""
    out = {}
    for path in sorted(MOLT.rglob("*.py")):
        parts = path.relative_to(MOLT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def imports(source: str, modules) -> set[str]:
    """The molt modules a source imports anywhere in it; `from molt.a import b` imports molt.a.b if that is a module."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"line {node.lineno}: a relative import (molt imports by absolute name)"
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("molt."):
                out.add(name)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, as the nodes along it (first == last), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every path from it is explored

    def visit(node, path):
        state[node], path = "open", path + [node]
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path)):
                return cycle
        state[node] = "done"

    return next((c for n in sorted(graph) if n not in state and (c := visit(n, []))), None)


def test_no_import_cycles():
    src = sources()
    graph = {m: imports(s, src) - {m} for m, s in src.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "module cycle: " + " -> ".join(cycle) + " (move the shared piece below both)"

    def package(m):  # molt.actor.group -> actor; top-level modules (molt.loop) are no package
        return m.split(".")[1] if m.count(".") >= 2 else None

    packages: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if package(m):
            packages.setdefault(package(m), set()).update(package(d) for d in deps if package(d) not in (None, package(m)))
    cycle = find_cycle(packages)
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


def code_lines(source: str) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a docstring."""
    docs = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
            docs.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in NOT_CODE:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docs)


def test_find_cycle_and_code_lines_count_what_they_say():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"a"}, "a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    src = '"""doc\nstring"""\nimport molt.b\n\n# note\ndef f():\n    """doc"""\n    from molt.a import c\n    return 1  # why\n'
    assert code_lines(src) == 4
    assert imports(src, {"molt.a", "molt.a.c", "molt.b"}) == {"molt.a.c", "molt.b"}


def test_code_size_within_budget():
    n = sum(code_lines(s) for s in sources().values())
    print(f"molt/: {n} code lines (budget {BUDGET})")
    assert n <= BUDGET, f"molt/ has {n} code lines, over the budget of {BUDGET} (ARCHITECTURE.md): delete before adding"
