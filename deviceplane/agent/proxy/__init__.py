"""Proxy mode: the agent between unmodified device plugins and a real kubelet.

Plugins register with the agent (its `--plugin-dir`); per resource the agent serves a DevicePlugin endpoint in the
kubelet's directory and registers it with the kubelet. ListAndWatch is streamed through (and recorded), the other RPCs
are forwarded as wire bytes. Owners come from the kubelet's PodResources API. The kubelet allocates; the agent only
observes.
"""
