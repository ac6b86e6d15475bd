"""The Kubernetes endpoint picker: an Envoy ``ext_proc`` front end over the routing core.

A gateway (Envoy Gateway, kgateway, Istio, GKE) asks the picker which pod of an
``InferencePool`` should serve each request (the Gateway API Inference Extension's endpoint
picker protocol). The picker parses the body as the OpenAI API, makes the same decision as
``kvroute serve`` (the same tokenizer, KV-event prefix index, policy and dispatch ledger),
answers with an ordered fallback list, and follows the response to close the request in the
ledger on the pod that really served it.
"""
