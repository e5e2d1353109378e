"""What a job is to the producer: its payload (``payloads``, the encoder of ``submit()``'s
arguments, whose one written signature is ``signatures``), its handle and fold of events
(``job``) and its final ``Result`` (``results``)."""
