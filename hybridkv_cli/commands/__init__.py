"""The commands of the command line, one module each: the flags a command takes and the run they
make (:mod:`hybridkv_cli.runs`). :mod:`hybridkv_cli.cli` registers them and maps errors to exit codes.
Heavy imports (torch, transformers, media decoders) happen inside the commands, so ``--help`` and
usage errors stay fast."""
