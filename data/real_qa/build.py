"""Build data/real_qa/ from real English text installed on this machine.

    .venv/bin/python data/real_qa/build.py            # write passages.jsonl, questions.jsonl, held_out.txt
    .venv/bin/python data/real_qa/build.py --preview  # print every passage with its word count, write nothing

Every passage is a contiguous slice of one source text: a file under /usr/share/doc, a package's
METADATA (its README) under the virtual environment's site-packages, a docstring of a CPython
3.11.7 standard-library module (read with `ast`, as `help()` shows it), or a topic of the
standard library's `pydoc_data/topics.py`. The only change made to the source text is
whitespace: lines wrapped inside a paragraph are joined with one space (a line starting with a
list bullet keeps its line break), runs of spaces become one, paragraphs are separated by one
blank line. A slice runs from the first occurrence of `start` to the end of the first
occurrence of `end` after it.

Questions, answers and aliases are written by hand below, one per passage. Distractors are
chosen here, reproducibly: the passages nearest to the gold passage by TF-IDF cosine that do
not contain the answer or any alias, 3 to 9 of them.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
STDLIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
SITE = Path("/work/main/.venv/lib/python3.11/site-packages")
DOC = Path("/usr/share/doc")

PSF = "PSF-2.0"
BULLET = re.compile(r"^\s*([-*+\u2022]|\d+[.)])\s+")


# --- reading and normalising -------------------------------------------------------------------
def read_file(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8")


CODE_START = (">>>", "$ ", "```", "# ", "+--", "|")
RULE = re.compile(r"^\s*([-=~*#])\1{2,}\s*$|^\s*={3,} +=")  # heading underline or rst table border
INLINE_COMMENT = re.compile(r"\S {2,}# | ::= ")  # code with an aligned trailing comment, grammar rules


def is_code(lines: list[str]) -> bool:
    """A paragraph is kept line by line (code, tables, diagrams) when a line is indented deeper
    than the first one or starts like a prompt, a comment, a fence or a table row."""
    indent = [len(line) - len(line.lstrip()) for line in lines]
    hanging = bool(BULLET.match(lines[0]))  # a list item's continuation lines may be indented
    return ((not hanging and any(i > indent[0] for i in indent[1:]))
            or any(line.lstrip().startswith(CODE_START) or RULE.match(line) or INLINE_COMMENT.search(line)
                   for line in lines))


def normalize(text: str) -> str:
    """Join wrapped lines inside prose paragraphs (a list item keeps its line break); keep code
    paragraphs line by line, dedented; one blank line between paragraphs."""
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    out = []
    for para in re.split(r"\n[ \t]*\n", text):
        lines = [line.rstrip() for line in para.split("\n") if line.strip()]
        if not lines:
            continue
        if len(lines) > 1 and is_code(lines):
            cut = min(len(line) - len(line.lstrip()) for line in lines)
            out.append("\n".join(line[cut:] for line in lines))
            continue
        lines = [line.strip() for line in lines]
        joined = lines[0]
        for line in lines[1:]:
            joined += ("\n" if BULLET.match(line) else " ") + line
        out.append(re.sub(r" {2,}", " ", joined))
    return "\n\n".join(out)


def docstring(path: Path, name: str) -> str:
    """The docstring of `name` in a Python file ("<module>", a class or function name, or a string assignment)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if name == "<module>":
        return ast.get_docstring(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return ast.get_docstring(node)
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name
                and isinstance(node.value, ast.Constant)):
            return node.value.value
    raise KeyError(f"{name} not found in {path}")


def pydoc_topic(key: str) -> str:
    source = (STDLIB / "pydoc_data/topics.py").read_text(encoding="utf-8")
    return ast.literal_eval(source.split("=", 1)[1])[key]


def metadata(dist: str) -> Path:
    (path,) = SITE.glob(f"{dist}-*.dist-info/METADATA")
    return path


@dataclass(frozen=True)
class Source:
    kind: str  # file | doc | topic | meta
    where: str  # path (file, doc), topic key, or distribution name (meta)
    name: str = ""  # docstring owner for kind "doc"

    def path(self) -> Path:
        if self.kind == "file":
            return Path(self.where)
        if self.kind == "doc":
            return STDLIB / self.where
        if self.kind == "topic":
            return STDLIB / "pydoc_data/topics.py"
        return metadata(self.where)

    def text(self) -> str:
        if self.kind == "file":
            raw = read_file(self.path())
        elif self.kind == "doc":
            raw = docstring(self.path(), self.name)
        elif self.kind == "topic":
            raw = pydoc_topic(self.where)
        else:
            raw = read_file(self.path())
        return normalize(raw)

    def describe(self) -> str:
        if self.kind == "doc":
            owner = "module docstring" if self.name == "<module>" else f"docstring of {self.name}"
            return f"CPython 3.11.7 Lib/{self.where}, {owner}"
        if self.kind == "topic":
            return f"CPython 3.11.7 Lib/pydoc_data/topics.py, topic {self.where!r} (Python Language Reference)"
        if self.kind == "meta":
            return f"{self.path().parent.name}/METADATA (package README)"
        if self.path().is_relative_to(STDLIB):
            return f"CPython 3.11.7 Lib/{self.path().relative_to(STDLIB)}"
        return str(self.path())


def doc(where: str, name: str = "<module>") -> Source:
    return Source("doc", where, name)


def usr(path: str) -> Source:
    return Source("file", str(DOC / path))


def meta(dist: str) -> Source:
    return Source("meta", dist)


def topic(key: str) -> Source:
    return Source("topic", key)


def stdlib_file(path: str) -> Source:
    return Source("file", str(STDLIB / path))


# --- passages and hand-written questions -----------------------------------------------------
# (id, title, source, licence, start, end, question, answer, aliases). start/end None: whole text.
P = [
    # CPython standard library (PSF licence)
    ("python-history", "History of Python", stdlib_file("LICENSE.txt"), PSF,
     "Python was created in the early 1990s", "was a sponsoring member of the PSF.",
     "Python was created as a successor of which language?", "ABC", []),
    ("random-module", "The random module", doc("random.py"), PSF, None, None,
     "What is the period of the Mersenne Twister core generator?", "2**19937-1", ["2^19937-1"]),
    ("decimal-module", "The decimal module", doc("_pydecimal.py"), PSF,
     "This is an implementation of decimal", "returns the expected Decimal('0.00')).",
     "Which IEEE standard is decimal floating point arithmetic in Python based on?", "854-1987",
     ["IEEE 854-1987", "IEEE standard 854-1987"]),
    ("heapq-module", "The heapq module", doc("heapq.py"), PSF, None, None,
     "What kind of indexing does the heapq API use?", "0-based indexing", ["0-based", "zero-based"]),
    ("heapq-tournament", "Heaps as tournaments (heapq notes by François Pinard)", doc("heapq.py", "__about__"), PSF,
     "In the tree above, each cell", "this is what I used for my MIDI sequencer :-).",
     "What did the author of the heapq notes use a heap for?", "MIDI sequencer", ["a MIDI sequencer", "my MIDI sequencer"]),
    ("turtle-module", "Turtle graphics", doc("turtle.py"), PSF,
     "Turtle graphics is a popular way", "which makes turtles very versatile geometrical objects.",
     "In which year was the original Logo programming language developed?", "1966", []),
    ("unittest-module", "The unittest framework", doc("unittest/__init__.py"), PSF,
     "Python unit testing framework", "retained in their original form.",
     "Whose Smalltalk testing framework is unittest based on, besides JUnit?", "Kent Beck", ["Kent Beck's"]),
    ("shelve-writeback", "shelve: mutable entries and writeback", doc("shelve.py"), PSF,
     "Normally, d[key] returns a COPY", "works as intended.",
     "Which keyword argument to shelve.open makes d[key].append(anitem) change the stored entry?",
     "writeback=True", ["writeback"]),
    ("sched-module", "The sched module", doc("sched.py"), PSF, None, None,
     "In the sched module, what do lower priority numbers mean?", "higher priority", ["higher"]),
    ("copy-module", "The copy module", doc("copy.py"), PSF, None, None,
     "Besides __getstate__() and __setstate__(), which method can a class define to control copying?",
     "__getinitargs__()", ["__getinitargs__", "getinitargs"]),
    ("pdb-commands", "pdb: breakpoint commands", doc("pdb.py", "do_commands"), PSF, None, None,
     "In a pdb breakpoint command list, which command suppresses the usual message about stopping at a breakpoint?",
     "silent", ["'silent'"]),
    ("timeit-module", "The timeit module", doc("timeit.py"), PSF,
     "Tool for measuring execution time", "is at least 0.2 seconds.",
     "In timeit, when the number of loops is not given, how long must the total time be at least?", "0.2 seconds", ["0.2"]),
    ("argparse-module", "The argparse module", doc("argparse.py"), PSF,
     "Command-line parsing library", "argument of add_argument() calls.",
     "Which module inspired argparse?", "optparse", []),
    ("sqlite3-module", "The sqlite3 module", doc("sqlite3/__init__.py"), PSF, None, None,
     "Which is the oldest SQLite version that the sqlite3 module requires?", "3.7.15", ["SQLite 3.7.15"]),
    ("statistics-spread", "statistics: spread and relations", doc("statistics.py"), PSF,
     "Calculating variability or spread", "StatisticsError is a subclass of ValueError.",
     "Which exception class is StatisticsError a subclass of?", "ValueError", []),
    ("smtplib-module", "The smtplib module", doc("smtplib.py"), PSF, None, None,
     "Which RFC covers SMTP Authentication?", "RFC 2554", ["2554"]),
    ("chunk-module", "IFF chunks", doc("chunk.py"), PSF, None, None,
     "What does RMFF stand for?", "RealMedia File Format", []),
    ("socketserver-classes", "socketserver class hierarchy", doc("socketserver.py"), PSF,
     "The classes in this module favor", "with your request handler class.",
     "Which class does UnixDatagramServer derive from?", "UDPServer", []),
    ("site-pth", "Path configuration files", doc("site.py"), PSF,
     "A path configuration file is a file", "not mentioned in either path configuration file.",
     "What is the file name extension of a path configuration file read by the site module?", ".pth", ["pth"]),
    ("cmd-module", "The cmd module", doc("cmd.py"), PSF,
     "A generic class to build line-oriented", "It defaults to \"=\".",
     "In the cmd module, which method is called when an empty line is entered?", "emptyline", ["emptyline()"]),
    ("plistlib-module", "The plistlib module", doc("plistlib.py"), PSF,
     "plistlib.py -- a tool", "or datetime.datetime objects.",
     "What kind of object is usually the top level object of a plist?", "a dictionary", ["dictionary"]),
    ("elementtree-module", "xml.etree.ElementTree", doc("xml/etree/ElementTree.py"), PSF, None, None,
     "In xml.etree.ElementTree, which class represents a single node in the tree?", "Element", []),
    ("io-module", "The io module", doc("io.py"), PSF,
     "The io module provides", "StringIO is an in-memory stream for text.",
     "Which abstract base class is at the top of the I/O hierarchy?", "IOBase", []),
    ("urlparse-rfcs", "RFCs behind urllib.parse", doc("urllib/parse.py"), PSF,
     "Parse (absolute and relative) URLs.", "good indicator of parsing behavior.",
     "Which RFC is considered the current standard for URL parsing?", "RFC 3986", ["3986"]),
    ("difflib-sequencematcher", "difflib.SequenceMatcher", doc("difflib.py", "SequenceMatcher"), PSF,
     "SequenceMatcher is a flexible class", "that has a *concept* of \"junk\" <wink>.",
     "Under what name did Ratcliff and Obershelp publish their algorithm?", "gestalt pattern matching", []),
    ("textwrap-wrapper", "textwrap.TextWrapper", doc("textwrap.py", "TextWrapper"), PSF, None, None,
     "What is the default width of wrapped lines in textwrap's TextWrapper?", "70", []),
    ("tempfile-mkstemp", "tempfile.mkstemp", doc("tempfile.py", "mkstemp"), PSF, None, None,
     "Who is responsible for deleting the file created by tempfile.mkstemp?", "the caller", ["caller"]),
    ("subprocess-run", "subprocess.run", doc("subprocess.py", "run"), PSF, None, None,
     "Which exception does subprocess.run raise when the process takes too long?", "TimeoutExpired", []),
    ("shutil-terminal-size", "shutil.get_terminal_size", doc("shutil.py", "get_terminal_size"), PSF, None, None,
     "What size does the fallback parameter of shutil.get_terminal_size default to?", "(80, 24)", ["80, 24", "80x24"]),
    ("logging-basicconfig", "logging.basicConfig", doc("logging/__init__.py", "basicConfig"), PSF,
     "Do basic configuration for the logging system.", "`backslashreplace`.",
     "Which handler does basicConfig create by default?", "StreamHandler", []),
    ("typing-module", "The typing module", doc("typing.py"), PSF, None, None,
     "Which PEP defines the gradual typing that the typing module supports?", "PEP 484", ["484"]),
    ("uuid-module", "The uuid module", doc("uuid.py"), PSF,
     "UUID objects (universally unique identifiers)", "UUID('886313e1-3b8a-5372-9b90-0c9aee199e5d')",
     "Which function may compromise privacy because its UUID contains the computer's network address?",
     "uuid1()", ["uuid1"]),
    ("truth-testing", "Truth value testing", topic("truth"), PSF, None, None,
     "What do the Boolean operations \"or\" and \"and\" always return?", "one of their operands", ["their operands"]),
    ("integer-literals", "Integer literals", topic("integers"), PSF, None, None,
     "Python used C-style octal literals before which version?", "3.0", ["version 3.0"]),
    ("boolean-operations", "Boolean operations", topic("booleans"), PSF, None, None,
     "What does the expression \"not 'foo'\" produce?", "False", []),
    ("zipfile-zipfile", "zipfile.ZipFile", doc("zipfile.py", "ZipFile"), PSF, None, None,
     "Which zipfile compression constant means no compression?", "ZIP_STORED", []),
    ("json-dumps", "json.dumps", doc("json/__init__.py", "dumps"), PSF, None, None,
     "In json.dumps, what error does a circular reference cause when check_circular is false?", "RecursionError", []),
    # /usr/share/doc (Debian packages)
    ("zlib-readme", "zlib README", usr("zlib1g-dev/README.gz"), "Zlib",
     "zlib 1.2.13 is a general purpose", "For VMS, use make_vms.com.",
     "Which RFCs describe the zlib data format?", "1950 to 1952", ["RFCs 1950 to 1952"]),
    ("zlib-acknowledgments", "zlib acknowledgments and licence", usr("zlib1g-dev/README.gz"), "Zlib",
     "Acknowledgments:", "This notice may not be removed or altered from any source distribution.",
     "Who defined the deflate format used by zlib?", "Phil Katz", []),
    ("zlib-faq-formats", "zlib FAQ: zlib and gzip formats", usr("zlib1g-dev/FAQ.gz"), "Zlib",
     "18. Why does gzip give an error", "Read zlib.h for more details.",
     "Which format was designed to keep the name and last modification date of a single file?", "gzip",
     ["the gzip format", "gzip format"]),
    ("zlib-faq-4gb", "zlib FAQ: more than 4 GB", usr("zlib1g-dev/FAQ.gz"), "Zlib",
     "32. Can zlib work with greater than 4 GB", "then the limit is 16 exabytes.",
     "In zlib, what is the limit when the compiler's \"long\" type is 64 bits?", "16 exabytes", []),
    ("zlib-faq-http", "zlib FAQ: HTTP encodings and Deflate64", usr("zlib1g-dev/FAQ.gz"), "Zlib",
     "39. What's the difference between", "it's not worth the effort to implement.",
     "Which company introduced the Deflate64 format?", "PKWare", []),
    ("zlib-faq-contrib", "zlib FAQ: contrib and export controls", usr("zlib1g-dev/FAQ.gz"), "Zlib",
     "41. I'm having a problem with the zip functions", "and so is classified as EAR99.",
     "What is zlib's export control classification?", "EAR99", []),
    ("gzip-readme", "GNU gzip README", usr("gzip/README.gz"), "GFDL-1.3+ (gzip: GPL-3+)",
     "gzip (GNU zip) is a compression utility", "(packed or gzip'ed).",
     "Which algorithm does gzip use by default?", "LZ77", ["the LZ77 algorithm"]),
    ("gzip-vs-zip", "GNU gzip README: zip vs. gzip", usr("gzip/README.gz"), "GFDL-1.3+ (gzip: GPL-3+)",
     "Note about zip vs. gzip:", "are not associated with the GNU project.",
     "Since which version does GNU tar have a -z option that invokes gzip?", "1.11.2", ["GNU tar 1.11.2"]),
    ("zstd-intro", "Zstandard README", usr("zstd/README.md.gz"), "BSD-3-Clause or GPL-2",
     "__Zstandard__, or `zstd` as short version", "[Zstandard homepage](https://facebook.github.io/zstd/#other-languages).",
     "In which RFC is the Zstandard format documented?", "RFC8878", ["RFC 8878", "8878"]),
    ("zstd-small-data", "Zstandard: small data and dictionaries", usr("zstd/README.md.gz"), "BSD-3-Clause or GPL-2",
     "## The case for Small Data compression", "will provide the greatest benefits.",
     "What mode does Zstd offer to tune the algorithm for a selected type of data?", "training mode", []),
    ("libsodium-readme", "libsodium README", usr("libsodium23/README.markdown"), "ISC",
     "Sodium is a new, easy-to-use", "[ISC license](https://en.wikipedia.org/wiki/ISC_license).",
     "Libsodium is a fork of which library?", "NaCl", []),
    ("nettle-readme", "GNU Nettle README", usr("libnettle8/README"), "LGPL-3+ or GPL-2+",
     "What is GNU Nettle?", "use an object-oriented abstraction on top of the library.",
     "Which programming language has a Nettle module built on top of the library?", "Pike", ["the Pike language"]),
    ("gmp-readme", "GNU MP README", usr("libgmp-dev/README"), "LGPL-3+ or GPL-2+",
     "GNU MP is a library for arbitrary precision", "are made by calling these low-level functions.",
     "Which class of GNU MP functions performs rational arithmetic?", "mpq", []),
    ("openssh-readme", "OpenSSH portable README", usr("openssh-client/README"), "OpenSSH (BSD-style)",
     "This is the port of OpenBSD's excellent", "not just when using password authentication.",
     "Whose sample implementation is OpenSSH based on?", "Tatu Ylonen", ["Tatu Ylonen's"]),
    ("ed-readme", "GNU ed README", usr("ed/README.gz"), "unlimited permission (GNU ed: GPL-2+)",
     "For a description of the ed algorithm", "'z' for scrolling through the buffer.",
     "Which book describes the ed algorithm?", "Software Tools in Pascal", []),
    ("man-db-faq", "man-db FAQ: why man-db", usr("man-db/FAQ"), "GPL-2+",
     "Why use man-db instead of man?", "man-db handles all this out of the box.",
     "When did the man and man-db packages fork from a common code base?", "in the mid-1990s", ["mid-1990s"]),
    ("man-db-maintenance", "man-db FAQ: performance and maintenance", usr("man-db/FAQ"), "GPL-2+",
     "* Performance", "would probably be better off switching to man-db.",
     "How many full releases had man-db had since the start of 2008, as of February 2012?", "ten",
     ["ten full releases", "10"]),
    ("postgresql-common-readme", "Multi-version PostgreSQL architecture (postgresql-common)",
     usr("postgresql-common/README.md.gz"), "GPL-2+",
     "Multi-Version/Multi-Cluster PostgreSQL architecture", "each client must specify the correct port.",
     "In which year was the multi-version PostgreSQL architecture document written?", "2004", []),
    ("procps-history", "procps FAQ: why so many procps projects", usr("procps/FAQ.gz"), "LGPL-2.1+",
     "Why are there so many procps projects?", "This represents the Debian, Fedora and openSUSE fork of procps.",
     "Who wrote a new ps program for the package starting in 1997?", "Albert Cahalan", []),
    ("procps-faq", "procps FAQ: ps and top", usr("procps/FAQ.gz"), "LGPL-2.1+",
     "Why does \"ps -aux\" complain", "will fail to group tasks due to race conditions.",
     "Which kernel version do you need at least for correct %CPU of multi-threaded apps?", "2.6.10",
     ["the 2.6.10 kernel"]),
    ("coreutils-readme", "GNU coreutils README", usr("coreutils/README.gz"), "GPL-3+",
     "These are the GNU core utilities.", "with whatever name they want.",
     "Coreutils is the union of fileutils, sh-utils and which other package?", "textutils", []),
    ("coreutils-root-tests", "GNU coreutils README: running tests as root", usr("coreutils/README.gz"), "GPL-3+",
     "Running tests as root:", "than when run by less privileged users.",
     "When the coreutils tests are run as root, which non-root user do some of them use by default?", "nobody", []),
    ("base-passwd-readme", "Debian base-passwd README", usr("base-passwd/README"), "GPL-2",
     "This package supplies the \"master\" copies", "This is the registry of allocations.",
     "Which base-passwd utility makes sure that uids and gids in the 0-99 range match the Debian master copies?", "update-passwd", []),
    ("libpng-readme", "libpng README", usr("libpng16-16/README.gz"), "libpng",
     "README for libpng version 1.6.39", "Version 1.0.0 was released in March 1998.",
     "Which version was the first official release of libpng?", "0.89", ["Version 0.89"]),
    ("jpeg-overview", "IJG JPEG software overview", usr("libjpeg-dev/README.ijg.gz"), "IJG (BSD-style)",
     "This package contains C software to implement JPEG", "defined in the standard.",
     "How is JPEG pronounced?", "jay-peg", []),
    ("jpeg-legal", "IJG JPEG software legal issues", usr("libjpeg-dev/README.ijg.gz"), "IJG (BSD-style)",
     "In plain English:", "All Rights Reserved except as specified below.",
     "Which years does the copyright of the IJG JPEG software cover?", "1991-2020", []),
    ("groff-readme", "GNU groff README", usr("groff-base/README.gz"), "FSF all-permissive (groff: GPL-3+)",
     "This is the GNU `groff' document formatting system.", "in the directory `gnu/groff'.",
     "What kind of compiler do you need to install groff?", "a C++ compiler", ["C++"]),
    ("pkgconf-readme", "pkgconf README", usr("pkgconf-bin/README.md.gz"), "ISC",
     "`pkgconf` is a program which helps", "may also respect the PKG_CONFIG environment variable.",
     "Which autoconf macro is pkgconf typically used with?", "PKG_CHECK_MODULES", []),
    ("libffi-readme", "libffi README", usr("libffi8/README.md.gz"), "MIT (Expat)",
     "libffi-3.4.4 was released on", "handles type conversions for values passed between the two languages.",
     "What does FFI stand for?", "Foreign Function Interface", []),
    ("httplib2-readme", "httplib2 README", usr("python3-httplib2/README.md"), "MIT (Expat)",
     "httplib2 is a comprehensive HTTP client library", "ETag and Last-Modified cache validators.",
     "Besides ETag, which cache validator does httplib2's cache use?", "Last-Modified", []),
    # Package READMEs from site-packages
    ("requests-readme", "Requests README", meta("requests"), "Apache-2.0",
     "Requests allows you to send HTTP/1.1", "- Chunked HTTP Requests",
     "Which Python versions does Requests officially support?", "Python 3.10+", ["3.10+", "3.10"]),
    ("click-readme", "Click README", meta("click"), "BSD-3-Clause",
     "Click is a Python package for creating", "Hello, Click!\n```",
     "What does the name Click stand for?", "Command Line Interface Creation Kit", []),
    ("tqdm-overhead", "tqdm README: overhead", meta("tqdm"), "MPL-2.0 AND MIT",
     "Overhead is low", "``line feed \\n`` control characters.",
     "According to the tqdm README, how much overhead per iteration does ProgressBar have?", "800ns", ["800ns/iter"]),
    ("h11-readme", "h11 README", meta("h11"), "MIT",
     "This is a little HTTP/1.1 library", "twisted.web`` or whatever.",
     "Which library heavily inspired h11?", "hyper-h2", []),
    ("scipy-readme", "SciPy README", meta("scipy"), "BSD-3-Clause",
     "SciPy (pronounced \"Sigh Pie\")", "give SciPy a try!",
     "How is SciPy pronounced?", "Sigh Pie", []),
    ("diskcache-readme", "DiskCache README", meta("diskcache"), "Apache-2.0",
     "`DiskCache`_ is an Apache2 licensed", "And we can do it in pure-Python!",
     "Which web framework is DiskCache compatible with?", "Django", []),
    ("pyparsing-readme", "pyparsing README", meta("pyparsing"), "MIT",
     "The pyparsing module is an alternative approach", "and '^' operator definitions.",
     "Under what name has the parsing technique of pyparsing become widespread?", "Parsing Expression Grammars",
     ["PEGs", "PEG"]),
    ("dateutil-readme", "dateutil README: authors", meta("python_dateutil"), "BSD-3-Clause",
     "We welcome many types of contributions", "A table of release signing keys can be found below:",
     "Who wrote the dateutil module?", "Gustavo Niemeyer", []),
    ("psutil-readme", "psutil README", meta("psutil"), "BSD-3-Clause",
     "psutil (process and system utilities)", "<https://pypi.org/project/psutil/6.1.1/>`__.",
     "What is the latest psutil version that supports Python 2.7?", "6.1.1", ["psutil 6.1.1"]),
    ("mpmath-readme", "mpmath README: acknowledgments", meta("mpmath"), "BSD-3-Clause",
     "Numerous other people have contributed", "do not necessarily reflect the views of the sponsors.",
     "Who sponsored Fredrik's work on mpmath during summer 2009?", "the American Institute of Mathematics",
     ["American Institute of Mathematics"]),
    ("faiss-readme", "Faiss README", meta("faiss_cpu"), "MIT",
     "Faiss is a library for efficient similarity search", "Both single and multi-GPU usage is supported.",
     "Which group at Meta primarily develops Faiss?", "Fundamental AI Research", []),
    ("cloudpickle-readme", "cloudpickle README", meta("cloudpickle"), "BSD-3-Clause",
     "`cloudpickle` makes it possible", "resulting in a critical security vulnerability.",
     "Between which Python versions can cloudpickle send objects?", "exact same version of Python",
     ["the exact same version of Python", "same version of Python"]),
    ("truststore-readme", "truststore README", meta("truststore"), "MIT",
     "Truststore is a library which exposes", "add this functionality into Python itself. Wish us luck!",
     "Against what does truststore check certificates to avoid monster-in-the-middle attacks?",
     "certificate revocation lists", ["CRLs"]),
    ("anyio-readme", "AnyIO README", meta("anyio"), "MIT",
     "AnyIO is an asynchronous networking", "you can read about it `here <https://anyio.readthedocs.io/en/stable/why.html>`_.",
     "Besides asyncio, on top of which library does AnyIO work?", "Trio", []),
    ("jinja-readme", "Jinja README", meta("jinja2"), "BSD-3-Clause",
     "Jinja is a fast, expressive", "by restricting functionality too much.",
     "What can HTML templates use to prevent XSS from untrusted user input?", "autoescaping", []),
    ("urllib3-readme", "urllib3 README", meta("urllib3"), "MIT",
     "urllib3 is a powerful", "and you should too.",
     "How much test coverage does urllib3 have?", "100%", ["100% test coverage"]),
    ("rich-readme", "Rich README", meta("rich"), "MIT",
     "Rich is a Python library for _rich_ text", "with no additional configuration required.",
     "According to the Rich README, how many colors is the classic terminal limited to?", "16", ["16 colors"]),
]


# --- held-out prose (perplexity) ---------------------------------------------------------------
HELD_OUT = [
    (topic(k), PSF) for k in ("execmodel", "naming", "import", "exceptions", "try", "raise", "with",
                              "context-managers", "function", "class", "for", "while", "if", "break",
                              "continue", "return", "yield", "global", "nonlocal", "del", "assert",
                              "lambda", "dynamic-features", "bltin-null-object", "bltin-ellipsis-object",
                              "pass", "typesmodules")
] + [
    (usr("systemd/DISTRO_PORTING.md"), "LGPL-2.1+"),
    (usr("libglib2.0-0/README.md"), "LGPL-2.1+"),
    (usr("libpango-1.0-0/README.md"), "LGPL-2+"),
    (meta("httpx"), "BSD-3-Clause"),
    (meta("starlette"), "BSD-3-Clause"),
]


# --- building ----------------------------------------------------------------------------------
def slice_text(text: str, start: str | None, end: str | None, pid: str) -> str:
    if start is None:
        return text
    i = text.find(start)
    if i < 0:
        raise LookupError(f"{pid}: start {start!r} not found")
    j = text.find(end, i)
    if j < 0:
        raise LookupError(f"{pid}: end {end!r} not found after start")
    return text[i: j + len(end)]


WORD = re.compile(r"[a-z][a-z0-9_]+")
STOP = set("the a an and or of to in is it for on that this be with as are by from at can if not its was "
           "which you your will all any but have has use used when also more than other these such may into "
           "only one two each their there them they then so some".split())


def tfidf(texts: list[str]) -> list[dict[str, float]]:
    docs = [Counter(w for w in WORD.findall(t.lower()) if w not in STOP) for t in texts]
    df = Counter(w for d in docs for w in d)
    n = len(docs)
    vecs = []
    for d in docs:
        v = {w: (1 + math.log(c)) * math.log(n / df[w]) for w, c in d.items()}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        vecs.append({w: x / norm for w, x in v.items()})
    return vecs


def cosine(a: dict[str, float], b: dict[str, float]) -> float:
    if len(a) > len(b):
        a, b = b, a
    return sum(x * b.get(w, 0.0) for w, x in a.items())


def contains(text: str, needle: str) -> bool:
    return needle.lower() in text.lower()


def build(preview: bool) -> None:
    passages, questions = [], []
    ids = [p[0] for p in P]
    assert len(ids) == len(set(ids)), "duplicate passage ids"
    texts = {}
    errors: list[str] = []
    for pid, title, src, licence, start, end, q, a, aliases in P:
        try:
            text = slice_text(src.text(), start, end, pid)
        except LookupError as exc:
            errors.append(str(exc))
            continue
        texts[pid] = text
        n = len(text.split())
        if preview:
            print(f"===== {pid} [{n} words] {src.describe()}\nQ: {q}  A: {a}\n{text}\n")
        if not 100 <= n <= 400:
            print(f"!! {pid}: {n} words", file=sys.stderr)
        if not any(contains(text, x) for x in [a, *aliases]):
            print(f"!! {pid}: answer {a!r} not in passage", file=sys.stderr)
        passages.append({"id": pid, "title": title, "text": text, "source": src.describe(), "licence": licence})
    if errors:
        raise SystemExit("\n".join(errors))
    vecs = dict(zip(ids, tfidf([texts[i] for i in ids])))
    for k, (pid, title, src, licence, start, end, q, a, aliases) in enumerate(P):
        want = 3 + (5 * k) % 7  # 3..9 distractors
        ranked = sorted((i for i in ids if i != pid), key=lambda i: (-cosine(vecs[pid], vecs[i]), i))
        picked = [i for i in ranked if not any(contains(texts[i], x) for x in [a, *aliases])][:want]
        questions.append({"id": f"q{k + 1:03d}", "passage_id": pid, "question": q, "answer": a,
                          "aliases": list(aliases), "distractors": picked})
    held, seen = build_held_out(texts)
    if preview:
        print(f"{len(passages)} passages, held-out {len(held.encode())} bytes from {len(seen)} sources")
        return
    with open(HERE / "passages.jsonl", "w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    with open(HERE / "questions.jsonl", "w", encoding="utf-8") as f:
        for q in questions:
            f.write(json.dumps(q, ensure_ascii=False) + "\n")
    (HERE / "held_out.txt").write_text(held, encoding="utf-8")
    print(f"wrote {len(passages)} passages, {len(questions)} questions, held_out.txt "
          f"({len(held.encode())} bytes from {len(seen)} sources)")
    for d, lic in seen:
        print(f"  held-out: {d} [{lic}]")


def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def build_held_out(texts: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """Whole documents not used for passages; any paragraph sharing an 8-word run with a passage is dropped."""
    used = set().union(*(shingles(t) for t in texts.values()))
    parts, seen = [], []
    for src, licence in HELD_OUT:
        paras = [p for p in src.text().split("\n\n") if not (shingles(p) & used)]
        parts.append("\n\n".join(paras))
        seen.append((src.describe(), licence))
    return "\n\n".join(parts) + "\n", seen


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preview", action="store_true", help="print the passages, write nothing")
    build(ap.parse_args().preview)
