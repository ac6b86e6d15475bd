"""The async shell: the aiohttp app, the request pipeline, attempts and retries, the upstream
client, streaming and resume, the KV-event subscriber, metrics and admission.
"""
