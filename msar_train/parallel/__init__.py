"""DeepSpeed integration: config builder, pipeline module, expert parallelism, engine, planning.

Parallelism is applied from outside the model: nothing in ``msar_train.model`` imports DeepSpeed.
"""
