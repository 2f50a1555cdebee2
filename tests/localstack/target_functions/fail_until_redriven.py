"""A target that fails each attempt until its task has been redriven, then succeeds."""


class ThumbnailError(Exception):
    """A failure the worker retries (only ``dead_on_errors`` types dead-letter at once)."""


def handler(event, context):
    if event["redrive_count"] < 1:
        raise ThumbnailError(f"attempt {event['attempt']} of task {event['task_id']}: the image store is down")
    return {"thumbnail": f"{event['payload']['image']}.small.png", "redrive_count": event["redrive_count"],
            "attempt": event["attempt"]}
