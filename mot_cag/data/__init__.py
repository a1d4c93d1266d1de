"""Synthetic data in the fixed format of docs/synthetic-qa.md (see ``mot_cag.data.synthetic``)."""
