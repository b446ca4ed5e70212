"""The runs a command makes of the engine: a :class:`~hybridkv_cli.runs.session.Session` answers
inputs (one, a batch, several questions, ``.hkv`` files), and ``bench``, ``profile``, ``route``
and the Ray workers are loops over it; each answer becomes a record (:mod:`.record`)."""
