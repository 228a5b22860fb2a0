"""No import circle runs through a package's face.

import-linter (``make test`` runs ``lint-imports``; the contracts are in pyproject.toml) checks the
layers of the client, the public faces and, with its ``acyclic_siblings`` contract, that no modules
of one package import each other in a circle. What that contract cannot see is a circle through a
package's ``__init__``: a module that imports the face of a package holding it (its own package's,
or an ancestor's) while that face imports the module back, directly or through others. A face
imports its package's modules, so such an import is a circle in the design even where Python's
import order happens to let it run.

Oracle: the import graph as grimp (import-linter's engine) builds it from the source, every import
counted (at the top of a module, inside a function, or for type checking only).
"""

from __future__ import annotations

import grimp


def _circles_through_faces(graph: grimp.ImportGraph) -> list[str]:
    found = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if module.startswith(imported + ".") and graph.chain_exists(importer=imported, imported=module):
                found.append(f"{module} -> {imported} (which imports {module} back)")
    return found


def test_the_checker_finds_a_circle_through_a_face():
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg", imported="pkg.a")  # the face imports its modules
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg")  # ... and one of them its face: a circle
    graph.add_import(importer="pkg.c", imported="pkg")  # the face does not import c: no circle
    assert _circles_through_faces(graph) == ["pkg.b -> pkg (which imports pkg.b back)"]


def test_no_circle_runs_through_a_face():
    graph = grimp.build_graph("moegrad", "moegrad_service")
    assert _circles_through_faces(graph) == []
