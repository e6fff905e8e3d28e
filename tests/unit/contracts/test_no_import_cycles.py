"""No import cycles among the modules of services/, shared/ and cli/: a module's imports, at its top, inside a
function (the CLI's lazy loading included) or for type checking only, never lead back to it. A cycle is broken by
moving the shared piece to its owner or by making one side depend downward (the API hands the portal its
authentication; the workload kinds' package, not the registry below them, looks kinds up; who is who on the bus
lives below both the bus and its credentials, shared/busroles.py; the API reads audit records from audit's read
side, services/audit/records.py, not from the audit service's app), never by hiding an import inside a function."""

from __future__ import annotations

import grimp

PACKAGES = ("services", "shared", "cli")

def cycles(graph: grimp.ImportGraph) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (each holds at least one cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        # Tarjan's algorithm, iteratively (the graph is deep enough to matter for recursion)
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_cycle_among_the_products_modules() -> None:
    # imports for type checking count too: a cycle through them is still a knot in the design
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, exclude_type_checking_imports=False)
    found = sorted(sorted(c) for c in cycles(graph))
    assert found == [], f"import cycles: {found}"


def test_the_check_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "a.b", "a.c", "a.d"):
        graph.add_module(name)
    graph.add_import(importer="a.b", imported="a.c")
    graph.add_import(importer="a.c", imported="a.d")
    graph.add_import(importer="a.d", imported="a.b")
    assert cycles(graph) == [frozenset({"a.b", "a.c", "a.d"})]
