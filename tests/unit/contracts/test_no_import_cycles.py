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


def unit(module: str) -> str:
    """The folder a module belongs to, as the layering sees it: a core (`services.core.<name>`), a service's shell
    (`services.<name>`, its sub-packages included), or a top-level package (`shared`, `cli`)."""
    parts = module.split(".")
    if parts[0] == "services" and len(parts) > 2 and parts[1] == "core":
        return ".".join(parts[:3])
    if parts[0] == "services" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def folder_graph(graph: grimp.ImportGraph) -> grimp.ImportGraph:
    folders = grimp.ImportGraph()
    for module in sorted(graph.modules):
        folders.add_module(unit(module))
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = unit(module), unit(imported)
            if a != b:
                folders.add_import(importer=a, imported=b)
    return folders


def test_no_core_folder_in_a_cycle_and_cores_import_no_shell() -> None:
    # Folder pairs importing each other through a core (a shell and the core that shared its folder, two services
    # through their cores: admission <-> pipeline <-> preemption <-> scheduler) were what remained once no module
    # cycle was left. The cores now live under services/core/, below every shell: no cycle among folders holds a
    # core, and a core imports only other cores and shared/. (Shells of different services still import each
    # other's read models, and the composition root `services.stack` starts them all: those folder cycles hold no
    # core.)
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False, exclude_type_checking_imports=False)
    folders = folder_graph(graph)
    through_cores = sorted(sorted(c) for c in cycles(folders) if any(f.startswith("services.core.") for f in c))
    assert through_cores == []
    upward = sorted((core, f) for core in sorted(folders.modules) if core.startswith("services.core.")
                    for f in folders.find_modules_directly_imported_by(core)
                    if not (f.startswith("services.core") or f == "shared"))
    assert upward == [], f"cores importing above them: {upward}"


def test_the_folder_check_finds_a_shell_core_pair() -> None:
    graph = grimp.ImportGraph()
    for name in ("services.a.app", "services.core.a.rules", "shared.domain"):
        graph.add_module(name)
    graph.add_import(importer="services.a.app", imported="services.core.a.rules")
    graph.add_import(importer="services.core.a.rules", imported="services.a.app")  # the mutant: a core reaching up
    assert cycles(folder_graph(graph)) == [frozenset({"services.a", "services.core.a"})]
    assert unit("services.core.kube.kinds.jobset") == "services.core.kube"
    assert unit("services.executor.kube.app") == "services.executor"
