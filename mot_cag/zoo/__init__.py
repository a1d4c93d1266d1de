"""The zoo: tiny GPT-2, OPT and Qwen2 models trained here on synthetic fact QA, and their recipe.

Shipped models live in ``mot_cag/zoo/models/<name>/`` (safetensors, config, tokenizer, ``card.json``);
``mot_cag.zoo.models`` holds their specs, ``mot_cag.zoo.train`` the one-command recipe
(``python -m mot_cag.zoo.train NAME``), ``mot_cag.zoo.quick_eval`` the recipe's own measurements.
"""
