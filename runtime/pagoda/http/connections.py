"""How long the HTTP servers (`pagoda serve`, `pagoda router`) keep an idle keep-alive connection open."""

# A server that closes an idle connection first races its client's next request on that connection: the request
# is written to a closing socket and fails (one request of 128 in a served Poisson load through `vllm bench serve`,
# whose aiohttp pool keeps idle connections for 15 s, against uvicorn's default of 5 s). So the servers wait longer
# than the clients and balancers in front of them: aiohttp 15 s, httpx 5 s, AWS's load balancers 60 s; 75 s is
# nginx's default. The cost is an idle socket held that much longer.
IDLE_KEEP_ALIVE_SECONDS = 75
