"""The engine: what every host runs, and nothing of any host.

Claiming and leases (``claiming``), running a batch (``runner``, ``execution``), turning results
into settlements (``outcomes``, ``settling``, ``retry``), the maintenance pass (``maintenance``,
``reaper``), the outbox's delivery (``outbox``), bulk operations, schedules (``cron`` their
expressions), large payloads, trace context and the wake-up of idle workers. It reaches storage
only through the SPI (``rdq_core.storage.spi``) and AWS only through the adapters in
``rdq_core.aws``, which a host chooses.
"""
