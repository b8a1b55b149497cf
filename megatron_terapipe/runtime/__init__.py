"""Running a schedule on one stage: executor, transport, slice attention and K/V cache,
deferred weight gradients, cutting batches into cells."""
