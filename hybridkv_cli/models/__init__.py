"""Models and prompts: model names -> loaded models (:mod:`.registry`), the families and their
checkpoints, the offline demo and tiny random models, and a question about media or a text turned
into the model's inputs (:mod:`.prompt`)."""
