"""Enrichment: raw Nemotron rows -> enriched rows (context / question / answer with the relevant sentences, tokens,
loss mask) and quarantined rows with a reason, on Spark inside the Ray cluster. Two features run through it, the rows
and an optional document corpus, across four layers; read them bottom up:

1. Row logic, pure Python, one row or text at a time (unit-tested without Spark):
   ``schema`` (the input's Arrow schema), ``conversation`` (row -> Example or Quarantined), ``context`` and
   ``sentences`` (what selection reads and how it goes back in), ``relevance`` (embedding scores), ``dedup``
   (exact keys, MinHash, LSH), ``decontam`` (eval n-grams); for the corpus, ``corpus`` (files, sentences, search).
2. Batch functions, pandas in and out, that Spark's Python workers run: ``batches`` (prepare, finish, tokenize)
   and ``corpus_batches`` (split, embed, retrieve).
3. Spark wiring: ``passes`` (the DataFrame passes over the rows), ``row_guard`` (rows refused in the JVM),
   ``corpus_table`` (the corpus's sentence table), ``spark`` (the RayDP session) and ``jars`` (s3a).
4. The job: ``inputs`` and ``plan`` (what it reads, checked before Spark starts), ``waves`` (the input cut into
   parts done front to back), ``job`` (the sequence of passes, wave by wave) and ``report`` (the counts: every row
   leaves kept or quarantined, once).
"""
