"""Synthetic data in the fixed format of shared/spec/synthetic-qa.md (see ``mot_cag.data.synthetic``)."""
