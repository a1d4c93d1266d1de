"""mot-cag: long-context cache-augmented generation across heterogeneous LLMs.

Documents are prefilled once by a source LM into a disk-backed KV store; at question time the retrieved
cache chunks are translated by a Mixture-of-Translators into the cache space of the target LM.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``from mot_cag import Asker, Store`` without importing torch until one is used."""
    if name == "Asker":
        from mot_cag.pipeline.ask import Asker

        return Asker
    if name == "Store":
        from mot_cag.store.store import Store

        return Store
    raise AttributeError(f"module 'mot_cag' has no attribute {name!r}")


__all__ = ["Asker", "Store", "__version__"]
