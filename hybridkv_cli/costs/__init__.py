"""What a decode step costs on a GPU, modelled from the bytes each tier moves (:mod:`.step_model`)
and a device described by its bandwidths (:mod:`.profiles`)."""
