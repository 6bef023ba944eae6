"""Each database's catalogue of statements (taskrunner/runs/statements/) names the same
statements: one added for one database and forgotten for another fails here, unless the
catalogue declares it its own (OWN: a statement only that database has, such as PostgreSQL's
success with the next claim in one)."""
import ast

import pytest

from taskrunner.runs import sql
from taskrunner.runs.statements import mysql, postgresql, sqlite

CATALOGUES = (postgresql, sqlite, mysql)


def named(catalogue):
    """The public names `catalogue` defines itself (not those it imports), but its OWN."""
    with open(catalogue.__file__) as fh:
        tree = ast.parse(fh.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {name for name in names if not name.startswith("_")} - set(catalogue.OWN) - {"OWN"}


def test_every_statement_is_named_for_every_database():
    expected = named(postgresql)
    assert {"claim", "SUCCESS", "flow_claim", "BACKLOG", "INSERT_QUEUE"} <= expected
    for catalogue in CATALOGUES:
        assert named(catalogue) == expected, catalogue.__name__
        for own in catalogue.OWN:
            assert hasattr(catalogue, own), (catalogue.__name__, own)


def test_a_statement_missing_for_one_database_is_caught(tmp_path):
    forgot = tmp_path / "forgot.py"
    forgot.write_text('OWN = ()\nSUCCESS = "UPDATE ..."\n')

    class Forgot:
        __file__ = str(forgot)
        OWN = ()
    assert named(Forgot) != named(postgresql)


def test_the_executor_picks_each_backends_catalogue():
    assert sql.CATALOGUES == {"postgresql": postgresql, "sqlite": sqlite, "mysql": mysql}
    assert sql.INSERT_QUEUE == {backend: catalogue.INSERT_QUEUE
                                for backend, catalogue in sql.CATALOGUES.items()}


def test_no_guarded_claim_on_mysql():
    with pytest.raises(ValueError, match="no guarded claim on mysql"):
        sql.claim_statements("mysql", 1, guarded=True)
