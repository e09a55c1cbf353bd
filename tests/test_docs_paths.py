"""The architecture page names only modules that exist: a move that forgets the page fails here."""

import re

from tests.helpers import REPO

PAGE = REPO / "docs" / "architecture.md"
PATH = re.compile(r"`((?:serving|router|cluster|load_tests|tests|deploy|helm)/[\w/.-]+\.(?:py|yaml|json|sh|cpp))`")


def named_paths(text: str) -> list[str]:
    return PATH.findall(text)


def test_named_paths_are_read_from_backticks():
    assert named_paths("the page (`serving/engine/engine.py`, `router/x.py` and serving/not_quoted.py)") == [
        "serving/engine/engine.py", "router/x.py"]


def test_every_module_the_architecture_page_names_exists():
    missing = sorted({path for path in named_paths(PAGE.read_text()) if not (REPO / path).exists()})
    assert missing == []
