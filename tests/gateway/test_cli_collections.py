"""`hypic query --collection NAME` (repeatable) against a live gateway with two tenants: the names reach
/query's `collections` as any client's would, within the key's tenant only."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.testing import LiveServer

import gateways

KEYS = {"key-a": "alice", "key-b": "bob"}
CORPUS = [{"id": "corpus-varo", "title": "Varo", "text": "Varo is a city on the river Alna. Its mayor is Ines Kell."}]
NOTES = "The vault code of Brill is 4417; Tam Oke keeps the key in the cafe by the bridge."
RECIPES = "Brill soup is made of leeks, barley and the smoked fish of the river Alna."

runner = CliRunner()


@pytest.fixture(scope="module")
def gateway(tiny_tokenizer, tmp_path_factory):
    with gateways.gateway(tmp_path_factory.mktemp("cli-collections"), tiny_tokenizer, CORPUS, api_keys=json.dumps(KEYS),
                          headers={"Authorization": "Bearer key-a"}) as live:
        with httpx.Client(base_url=live.url, timeout=60, headers={"Authorization": "Bearer key-a"}) as alice:
            for collection, doc_id, text in (("notes", "vault", NOTES), ("recipes", "soup", RECIPES)):
                r = alice.post("/documents", params={"collection": collection}, json={"id": doc_id, "text": text})
                assert r.status_code == 201, r.text
        yield live


def query(live: LiveServer, key: str, *args: str):
    # HYPIC_API_KEY is the key the command sends; the gateway's own settings are not read from it here.
    return runner.invoke(cli, ["query", "Where is the key of Brill?", "--url", live.url, "--max-tokens", "2", "--sources", *args],
                         env={"HYPIC_API_KEY": key, "HYPIC_API_KEYS": None, "HYPIC_API_KEYS_FILE": None})


def sources(result) -> list[str]:
    """The `collection/document_id` (or bare document id for 'default') of each printed source."""
    return [line.split("] ", 1)[1].split(":", 1)[0] for line in result.stderr.splitlines() if line.startswith("[")]


def test_one_collection(gateway):
    result = query(gateway, "key-a", "--collection", "notes")
    assert result.exit_code == 0, result.output
    assert sources(result) == ["notes/vault"]


def test_repeated_collections_are_searched_together(gateway):
    result = query(gateway, "key-a", "--collection", "notes", "--collection", "recipes", "--collection", "default")
    assert result.exit_code == 0, result.output
    assert sorted(sources(result)) == ["notes/vault", "recipes/soup"]  # alice's 'default' is empty (the corpus is tenant 'default''s)


def test_without_collection_the_default_one(gateway):
    result = query(gateway, "key-a")
    assert result.exit_code == 0, result.output
    assert sources(result) == []  # alice's 'default' collection is empty; the corpus is the tenant 'default''s


def test_another_tenants_collection_is_refused_naming_the_field(gateway):
    result = query(gateway, "key-b", "--collection", "notes")
    assert result.exit_code == 1
    assert "collections[0]" in result.stderr and "no collection 'notes'" in result.stderr
    assert "4417" not in result.output


@pytest.mark.parametrize("name", ["Bad Name", "../alice"])
def test_an_invalid_name_is_refused_naming_the_field(gateway, name):
    result = query(gateway, "key-a", "--collection", "notes", "--collection", name)
    assert result.exit_code == 1
    assert "collections[1]" in result.stderr
