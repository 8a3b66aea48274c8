"""The slots users train in: AutoModel's recipes and the Hugging Face Trainer (each an optional extra, imported lazily).

* :mod:`~zephon_loader.integrations.recipe`: the dataloader-config protocols of AutoModel's LLM and VLM recipes.
* :mod:`~zephon_loader.integrations.automodel`: AutoModel's LLM recipe holding that config (``zephon_loader.automodel``).
* :mod:`~zephon_loader.integrations.hf`: ``ZephonTrainer`` (``zephon_loader.hf``).
"""
