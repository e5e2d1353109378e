"""The SDK's client core: what ``Client`` and ``AsyncClient`` do, written once, without I/O.

``client_core`` is the one sans-IO core; its parts have one module each: enqueueing
(``enqueue``), reading result streams (``reads``), what a producer knows of a queue
(``queues``), job status (``status``), the model listing (``models``), affinity routing
(``affinity``), the in-flight window (``window``) and the asyncio clients' shared readers
(``hub``). Every operation is a plan in the one style of ``effects``, whose two drivers (``run``,
``arun``) are the only code that differs between the two clients.
"""
