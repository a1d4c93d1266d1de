"""mot-cag: long-context cache-augmented generation across heterogeneous LLMs.

Documents are prefilled once by a source LM into a disk-backed KV store; at question time the retrieved
cache chunks are translated by a Mixture-of-Translators into the cache space of the target LM.
"""

__version__ = "0.1.0"
