"""The kinds of device memory a runner can release and resume (SGLang's memory saver tags), for
`ModelRunner.release_memory_occupation` and the engine's lifecycle verbs that call it."""

MEMORY_TAGS = ("weights", "kv_cache")


def check_memory_tags(tags) -> tuple[str, ...]:
    """`tags` of release/resume_memory_occupation: None (all) or a list of MEMORY_TAGS."""
    if tags is None:
        return MEMORY_TAGS
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of {list(MEMORY_TAGS)} or None, got {tags!r}")
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tag(s) {unknown}; the tags are {list(MEMORY_TAGS)}")
    return tuple(dict.fromkeys(tags))
