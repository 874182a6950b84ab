"""File formats of `hypic ingest` and uploads: reStructuredText, HTML, gzip'd files."""

from __future__ import annotations

import gzip
import json

import pytest
from typer.testing import CliRunner

from app.cli import cli
from retrieval import BinaryInputError, EmptyInputError, HashingEmbedder, InvalidInputError, UnsupportedFormatError, VectorIndex, load_documents, minilm_model_dir
from retrieval.formats import format_of, html_text, read_documents, rst_title

PAGE = """<!DOCTYPE html>
<html><head><title>Tide  tables</title><style>p { color: red; }</style>
<script>var hidden = "do not index";</script></head>
<body>
  <h1>Tides</h1>
  <p>The Moon pulls the   sea.
     Tides rise twice a day.</p>
  <div>Spring tides &amp; neap tides<br>alternate.</div>
  <ul><li>High water</li><li>Low water</li></ul>
  <pre>line one
    indented line two</pre>
  <noscript>Enable JavaScript</noscript>
  <table><tr><td>Brest</td><td>7 m</td></tr><tr><td>Dover</td><td>6 m</td></tr></table>
</body></html>
"""

RST = """=========
Overlined
=========

Intro paragraph.

Section
-------

Body text.
"""


def test_html_text_keeps_blocks_and_drops_scripts():
    text, title = html_text(PAGE)
    assert title == "Tide tables"
    assert text.split("\n\n") == [
        "Tides",
        "The Moon pulls the sea. Tides rise twice a day.",
        "Spring tides & neap tides\nalternate.",
        "High water\nLow water",
        "line one\n    indented line two",
        "Brest 7 m\nDover 6 m",
    ]
    assert "hidden" not in text and "color" not in text and "JavaScript" not in text


def test_html_title_falls_back_to_the_first_h1_then_the_stem():
    assert html_text("<h1>First <em>heading</em></h1><h1>Second</h1><p>x</p>")[1] == "First heading"
    [page] = read_documents(b"<p>Only a paragraph.</p>", "plain.html", "plain.html", "test")
    assert (page.title, page.text) == ("plain", "Only a paragraph.")
    with pytest.raises(EmptyInputError, match="no text outside the HTML markup"):
        read_documents(b"<script>x = 1</script><p>  </p>", "blank.htm", "blank.htm", "test")


def test_rst_title_is_the_first_adorned_line():
    assert rst_title(RST) == "Overlined"
    assert rst_title("Intro line\n\nSection\n=======\n") == "Section"
    assert rst_title("Too short\n===\n") == ""
    [doc] = read_documents(RST.encode(), "guide.rst", "docs/guide.rst", "test")
    assert (doc.document_id, doc.title, doc.text) == ("docs/guide.rst", "Overlined", RST)
    [untitled] = read_documents(b"No title here.\n", "notes.rst", "notes.rst", "test")
    assert untitled.title == "notes"


@pytest.mark.parametrize("name, expected", [
    ("a.txt", (".txt", False)), ("A.MD", (".md", False)), ("b.rst.gz", (".rst", True)), ("c.html.GZ", (".html", True)),
    ("d.htm", (".htm", False)), ("e.jsonl.gz", (".jsonl", True)), ("f.gz", None), ("g.tar.gz", None), (".md", None), ("h.pdf", None),
])
def test_format_of(name, expected):
    assert format_of(name) == expected


@pytest.mark.parametrize("name, content, title, text", [
    ("notes.txt.gz", "Plain text about tides.", "notes", "Plain text about tides."),
    ("guide.md.gz", "# Brewing\n\nUse fine grounds.", "Brewing", "# Brewing\n\nUse fine grounds."),
    ("manual.rst.gz", "Manual\n======\n\nRead me.", "Manual", "Manual\n======\n\nRead me."),
    ("page.html.gz", "<title>Page</title><p>Hello <b>web</b>.</p>", "Page", "Hello web."),
])
def test_gzipped_text_files_read_like_plain_ones(name, content, title, text):
    [doc] = read_documents(gzip.compress(content.encode()), name, name, "test")
    assert (doc.document_id, doc.title, doc.text) == (name, title, text)


def test_gzipped_jsonl_and_bad_gzip():
    lines = [{"id": "j1", "text": "Jupiter is large."}, {"id": "j2", "text": "Mars is red.", "title": "Mars"}]
    body = gzip.compress("\n".join(json.dumps(line) for line in lines).encode())
    assert [(d.document_id, d.title) for d in read_documents(body, "p.jsonl.gz", "ignored", "p.jsonl.gz")] == [("j1", "j1"), ("j2", "Mars")]
    with pytest.raises(BinaryInputError, match="not a valid gzip file"):
        read_documents(b"plain bytes, not gzip", "x.txt.gz", "x.txt.gz", "x.txt.gz")
    with pytest.raises(BinaryInputError, match="not a valid gzip file"):
        read_documents(gzip.compress(b"truncated stream " * 50)[:-12], "x.txt.gz", "x.txt.gz", "x.txt.gz")
    with pytest.raises(InvalidInputError, match="decompresses to more than 1000 bytes"):
        read_documents(gzip.compress(b"a" * 5000), "bomb.txt.gz", "bomb.txt.gz", "upload", max_bytes=1000)
    with pytest.raises(UnsupportedFormatError, match=r"'\.tar\.gz'"):
        read_documents(b"", "x.tar.gz", "x", "x.tar.gz")


def test_directory_walk_and_cli_ingest_every_format(tmp_path):
    root = tmp_path / "docs"
    root.mkdir()
    (root / "page.html").write_text(PAGE)
    (root / "guide.rst").write_text(RST)
    (root / "notes.md.gz").write_bytes(gzip.compress(b"# Notes\n\nCompressed notes about rivers."))
    (root / "old.htm.gz").write_bytes(gzip.compress(b"<h1>Old page</h1><p>Legacy text.</p>"))
    (root / "lines.jsonl.gz").write_bytes(gzip.compress(b'{"id": "line-1", "text": "From a gzip JSONL file."}\n'))
    (root / "archive.tar.gz").write_bytes(b"skipped")
    documents, skipped = load_documents([root])
    assert {d.document_id: d.title for d in documents} == {
        "docs/guide.rst": "Overlined", "line-1": "line-1", "docs/notes.md.gz": "Notes", "docs/old.htm.gz": "Old page", "docs/page.html": "Tide tables"}
    assert skipped == (f"{root / 'archive.tar.gz'} (unsupported type)",)

    result = CliRunner().invoke(cli, ["ingest", str(root), "--index-dir", str(tmp_path / "index"), "--embedder", "hashing-64",
                                      "--tokenizer", str(minilm_model_dir())])
    assert result.exit_code == 0, result.output
    assert "ingested 5 documents" in result.stdout
    index = VectorIndex(tmp_path / "index", HashingEmbedder(64))
    assert "Brest 7 m" in index.chunks("docs/page.html")[0].text
    assert index.search("compressed notes rivers", top_k=1)[0].chunk.document_id == "docs/notes.md.gz"


def test_html_that_is_not_utf8_decodes_as_a_browser_would():
    declared = '<html><head><meta http-equiv="Content-Type" content="text/html; charset=ISO-8859-1"></head><p>Café crème</p></html>'
    assert read_documents(declared.encode("latin-1"), "a.html", "a.html", "test")[0].text == "Café crème"
    undeclared = "<p>Smart \u201cquotes\u201d and na\u00efve</p>".encode("windows-1252")
    assert read_documents(undeclared, "b.htm", "b.htm", "test")[0].text == "Smart \u201cquotes\u201d and na\u00efve"
    with pytest.raises(BinaryInputError, match="nor 'utf-16-nope' as its <meta> says"):
        read_documents(b'<meta charset="utf-16-nope"><p>\xff\xfe</p>', "c.html", "c.html", "test")
    with pytest.raises(BinaryInputError, match="not UTF-8 text"):
        read_documents("<p>Café</p>".encode("latin-1"), "d.txt", "d.txt", "test")  # only HTML guesses
