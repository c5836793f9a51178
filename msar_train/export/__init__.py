"""Hugging Face ``transformers`` export of a training checkpoint, and generation from it (README
"Export, generate, evaluate"). ``configuration_msar.py`` / ``modeling_msar.py`` are copied verbatim
into every exported folder as its remote code; they import this package for the model math."""
