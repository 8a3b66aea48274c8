"""Shard folders on object storage (``s3://``, ``gs://``/``gcs://``, ``az://``): listed, identified, and read
through Zephon's own client.

The remote branch of the shard-files step (config → builder → **shard files** →
work source → tokenize → pack → batch); :func:`zephon_loader.pipeline.shards.open_source`
hands a URL here. Zephon 0.2 reads such prefixes itself (its ``cloud`` extra:
obstore); this module adds what the loader needs around that read:

* **Listing**: the objects directly under the prefix, in Zephon's order (sorted
  names), one format, with their size, ETag and time of last change: one list
  request per 1,000 objects, nothing downloaded.
* **Identity** (the resume fingerprint's shard part): per object its size and
  ETag (the store's content tag: a replaced object gets a new one), not a hash
  of its bytes. A state saved on a local copy is therefore refused on the same
  shards in a bucket (and the other way): the message says so.
* **Credentials and endpoint** come from where Zephon's client reads them (for
  S3: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
  ``~/.aws/credentials`` with ``AWS_PROFILE``, ``AWS_REGION``, instance
  metadata; ``S3_ENDPOINT_URL`` for an S3-compatible store, plain ``http://``
  allowed; checked to be ``http(s)://host[:port]`` at build, :func:`check_endpoint`). The loader never
  reads, stores, logs or prints them: a store's error is cut to its status and error code
  (:func:`store_error`), a Rust client's panic is caught as a store failure (:func:`store_raised`), and every
  URL in a message has its ``user:password@`` and query values masked (:func:`redact`).
* **Keys**: a prefix or shard key with ``?``, ``#`` or a control character is refused by name
  (:func:`check_keys`): Zephon's client cuts a URL at ``?``/``#`` and cannot read a tab.
* **Zephon's shard cache** (:func:`store_options`): Zephon downloads remote
  shards into a cache folder it reuses by name and size; the loader gives it a
  folder keyed by the objects' ETags (under :func:`~zephon_loader.pipeline.shards.cache_dir`),
  so a replaced object is never read from a stale copy, and bounds its retries
  (:data:`RETRIES`) so that a store gone for good fails in about a minute
  instead of hanging for several.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zephon_loader.errors import described_error as _described
from zephon_loader.errors import field_error as _err

__all__ = ["ENDPOINT_ENV", "EXTRA_OF_SCHEME", "RETRIES", "check_endpoint", "check_keys", "is_url", "list_objects",
           "redact", "remote_changes", "store_error", "store_failure", "store_options", "store_raised"]

#: URL scheme -> the ``zephon-loader`` extra that installs its client (all are Zephon's ``cloud`` extra).
EXTRA_OF_SCHEME = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "azure": "azure", "abfs": "azure",
                   "abfss": "azure"}

#: What Zephon's shard cache does when a download fails: ``download_retry`` attempts per open, and
#: ``open_retry_attempts`` opens (Zephon 0.2's defaults are 12 and 5; each attempt is itself retried by obstore
#: with backoff for a few seconds). With these a short outage (seconds) is ridden out and a store that stays
#: down fails after about a minute, naming the object.
RETRIES = {"download_retry": 3, "open_retry_attempts": 2}

_CHECK = {
    "s3": "the bucket name, AWS_REGION, S3_ENDPOINT_URL (for an S3-compatible store) and the credentials "
          "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials)",
    "gcs": "the bucket name and the credentials (GOOGLE_APPLICATION_CREDENTIALS or gcloud's application-default "
           "login)",
    "azure": "the container and account names and the credentials (AZURE_STORAGE_ACCOUNT_NAME with "
             "AZURE_STORAGE_ACCOUNT_KEY, a SAS token, or az login)",
}


def is_url(path: str) -> bool:
    """Whether a configured source path is a URL (``scheme://...``) rather than a local folder (``pkg://`` is
    the package's own data folder, a local path)."""
    from zephon_loader.config.schema import PACKAGE_DATA_PREFIX

    return "://" in str(path) and not str(path).startswith(PACKAGE_DATA_PREFIX)


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower()


def check_url(where: str, url: str) -> str:
    """The URL normalized (no trailing ``/``) after checking its scheme, bucket and client.

    Raises:
        ValueError: An unknown scheme (``hf://`` included: it needs the network at every build; download the
            split and point the source at the folder), no bucket, or the client not installed (naming the
            ``pip install`` command).
    """
    scheme = _scheme(url)
    if scheme not in EXTRA_OF_SCHEME:
        raise ValueError(_err(where, url, "a local directory or a URL of object storage: s3://bucket/prefix, "
                                          "gs://bucket/prefix (gcs://), az://container/prefix",
                              f"The scheme {scheme!r} is not read by the loader; download the shards and point the "
                              "source at the local directory."))
    rest = url.split("://", 1)[1].strip("/")
    if not rest:
        raise ValueError(_err(where, url, f"{scheme}://<bucket>/<prefix>", "Name the bucket (and the prefix)."))
    if "@" in rest.split("/", 1)[0]:
        raise ValueError(_err(where, redact(url), f"{scheme}://<bucket>/<prefix> without credentials",
                              f"Remove the user:password@ part; give the credentials as {_CHECK_CREDENTIALS}."))
    bucket, _, prefix = rest.partition("/")
    check_keys(where, f"{scheme}://{bucket}", [prefix or bucket])
    if scheme == "s3":
        check_endpoint()
    try:
        import obstore  # noqa: F401 - Zephon's client for every object store
    except ImportError:
        raise ValueError(_err(where, url, "the object-storage client installed (obstore)",
                              f"Install it: pip install 'zephon-loader[{EXTRA_OF_SCHEME[scheme]}]'.")) from None
    return f"{scheme}://{rest}"


_CHECK_CREDENTIALS = ("the environment variables or files your store's client reads (for S3: AWS_ACCESS_KEY_ID/"
                      "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials)")
#: The endpoint variable Zephon's S3 client reads (``zephon._internal.io.storage.s3``).
ENDPOINT_ENV = "S3_ENDPOINT_URL"
#: Characters a key cannot hold here: Zephon splits a URL with ``urllib.parse`` (``?`` starts a query, ``#`` a
#: fragment: the key is cut there) and obstore refuses control characters (a tab) in a path.
_BAD_KEY = re.compile(r"[?#\x00-\x1f\x7f]")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)?[^/?#@]*@")


def redact(url: str) -> str:
    """A URL (or a value meant as one) with the credentials it may carry masked: ``user:password@`` and the
    query (``http://***@host:9000/?***``)."""
    return _USERINFO.sub(r"\1***@", url.split("?", 1)[0]) + ("?***" if "?" in url else "")


def check_keys(where: str, url: str, keys: Sequence[str]) -> None:
    """Refuse object keys (or a prefix) that hold ``?``, ``#`` or a control character: Zephon's client cannot
    read them (it cuts a URL at ``?``/``#``; obstore refuses a tab), so they would fail with a misleading
    "not found" or a credentials hint."""
    bad = [k for k in keys if _BAD_KEY.search(k)]
    if bad:
        shown = ", ".join(repr(k) for k in bad[:3]) + (f", and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ValueError(_described(where, f"the key(s) {shown} of {url}",
                                    "object keys without '?', '#' or control characters (a tab, a newline)",
                                    "Zephon's client cuts a URL at '?' or '#' and cannot read a key with a control "
                                    "character; copy the objects to keys without them (e.g. '_' instead)."))


def check_endpoint() -> None:
    """Refuse an ``S3_ENDPOINT_URL`` that is not ``http(s)://host[:port]`` (no path, query or fragment) before any
    store is made: one without a scheme made obstore panic (a ``PanicException``, which ``except Exception`` does not catch) naming neither
    the variable nor the source.

    Raises:
        ValueError: Naming the variable, its value with any credential masked, and the form expected.
    """
    value = os.environ.get(ENDPOINT_ENV)
    if not value:
        return
    parsed = urllib.parse.urlsplit(value)
    try:
        parsed.port  # noqa: B018 - raises on a port that is not a number
        # A path, query or fragment is not part of an endpoint: the client would build object URLs on it and
        # find no shard, naming the prefix instead of the variable.
        valid = (parsed.scheme in ("http", "https") and bool(parsed.hostname) and parsed.path in ("", "/")
                 and not parsed.query and not parsed.fragment)
    except ValueError:
        valid = False
    if not valid:
        raise ValueError(_err(ENDPOINT_ENV, redact(value), "http://host:port or https://host:port (the address of "
                                                           "the S3-compatible store, with its scheme, without a "
                                                           "path or query)",
                              f"Set e.g. {ENDPOINT_ENV}=http://127.0.0.1:9000, or unset it for AWS S3; credentials "
                              f"go in {_CHECK_CREDENTIALS}, not in the URL."))


def store_raised(error: BaseException) -> bool:
    """Whether ``error`` is a store client's failure to report (any ``Exception``, and the ``PanicException`` a
    Rust client raises, which derives from ``BaseException``), not an interrupt or an exit."""
    return isinstance(error, Exception) or type(error).__name__ == "PanicException"


def store_error(error: BaseException) -> str:
    """What a store answered, in one short phrase and without any credential: ``NoSuchBucket (HTTP 404)``,
    ``connection refused``, ...; the type name when nothing better is found."""
    text = str(error)
    code = re.search(r"<Code>([^<]{1,80})</Code>", text)
    status = re.search(r"status code: (\d{3})", text)
    if code:
        return f"{code.group(1)}" + (f" (HTTP {status.group(1)})" if status else "")
    if status:
        return f"HTTP {status.group(1)}"
    lowered = text.lower()
    for needle, phrase in (("connection refused", "connection refused"), ("timed out", "timed out"),
                           ("dns error", "the host name does not resolve"), ("tcp connect", "no connection"),
                           ("error sending request", "no connection"), ("credential", "no usable credentials"),
                           ("illegal character", _KEY_PHRASE)):
        if needle in lowered:
            return phrase
    return type(error).__name__


_KEY_PHRASE = "an object key the client cannot read (a tab or another control character)"


def store_failure(where: str, url: str, error: BaseException, doing: str) -> str:
    """One line for a store that failed: the source, the URL, what the store answered, what to check."""
    endpoint = ""
    if _scheme(url) == "s3":
        custom = os.environ.get(ENDPOINT_ENV)
        endpoint = f" (endpoint {ENDPOINT_ENV}={redact(custom)})" if custom else ""
    answer = store_error(error)
    if answer == _KEY_PHRASE:
        advice = ("Copy the objects under it whose keys hold a tab or another control character to keys without "
                  "them (Zephon's client cannot list or read them).")
    else:
        advice = f"Check {_CHECK[EXTRA_OF_SCHEME[_scheme(url)]]}, and that the store is reachable from this machine."
    return f"{where}: {doing} {redact(url)}{endpoint} failed: {answer}. {advice}"


def list_objects(where: str, url: str, doing: str = "listing") -> list[dict[str, Any]]:
    """The objects directly under ``url`` (sorted by name), each ``{"name", "size", "e_tag", "last_modified"}``.

    Raises:
        ValueError: The store refused or could not be reached (:func:`store_failure`, ``doing`` ``url``).
    """
    from zephon_loader.zephon_compat import store_objects

    try:
        return store_objects(url)
    except BaseException as error:  # obstore's errors have no common base; a Rust panic is a BaseException
        if not store_raised(error):
            raise
        raise ValueError(store_failure(where, url, error, doing)) from None


def identity(obj: dict[str, Any]) -> tuple[int, str, int]:
    """``(size, ETag, last change in ns)`` of a listed object (an object without an ETag: ``""``)."""
    modified = obj.get("last_modified")
    ns = int(modified.timestamp() * 1e9) if modified is not None else 0
    return int(obj["size"]), str(obj.get("e_tag") or "").strip('"'), ns


def digest_of(ident: Sequence[Any]) -> str:
    """The fingerprint digest of a remote object: SHA-256 over ``etag:<ETag>:<size>`` (the same ETag and size
    give the same digest on any bucket that holds a byte-identical upload)."""
    return hashlib.sha256(f"etag:{ident[1]}:{ident[0]}".encode()).hexdigest()


def remote_changes(where: str, url: str, files: Sequence[str], identities: Sequence[Sequence[Any]]) -> list[str]:
    """What changed under ``url`` since the build, as :meth:`SourceFiles.changes` words it (one listing).

    Raises:
        ValueError: The store cannot be reached now (:func:`store_failure`): not a change of the shards.
    """
    now = {o["name"]: identity(o) for o in list_objects(where, url, "reading the shards at")}
    out = []
    for name, before in zip(files, identities, strict=True):
        after = now.get(name)
        shown = f"{url}/{name}"
        if after is None:
            out.append(f"{shown}: removed")
        elif after[0] != before[0]:
            out.append(f"{shown}: {before[0]} -> {after[0]} bytes")
        elif after[1] != before[1]:
            out.append(f"{shown}: replaced (same size, new ETag)")
    return out


def store_options(sources: Sequence[Any], cache: Path) -> dict[str, Any]:
    """Zephon ``RuntimeOptions`` for remote sources: ``{"io_options": StoreOptions(...)}``, or ``{}`` when every
    source is local. Zephon's shard cache goes to ``cache/objects/<key>``, the key made of every remote
    object's URL, size and ETag."""
    remote = [s for s in sources if s.remote]
    if not remote:
        return {}
    from zephon.io.options import CacheOptions, StoreOptions

    key = hashlib.sha256(json.dumps([[s.folder, s.fingerprint()] for s in remote]).encode()).hexdigest()[:24]
    root = Path(cache) / "objects" / key
    return {"io_options": StoreOptions(cache=CacheOptions(enabled=True, root=str(root), **RETRIES))}


def read_parquet_schema(url: str, size: int) -> Any:
    """The Arrow schema of a Parquet object, from two range reads of its footer (nothing else downloaded)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zephon_loader.zephon_compat import read_object_range

    tail = read_object_range(url, max(0, size - 8), size)
    length = int.from_bytes(tail[:4], "little")
    footer = read_object_range(url, max(0, size - 8 - length), size)
    return pq.read_schema(pa.BufferReader(b"PAR1" + footer))
