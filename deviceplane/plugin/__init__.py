"""deviceplane.plugin: write a Kubernetes device plugin in a few lines of Python.

A DevicePlugin is a resource name, a device list (replace it any time with `set_devices`) and optional hooks;
`plugin.run()` blocks, `await plugin.serve()` is the asyncio form. See the README for a complete example.
"""

from deviceplane.plugin.devices import DeviceListTooLarge
from deviceplane.plugin.models import Allocation, Device, DeviceSpec, Mount
from deviceplane.plugin.plugin import DevicePlugin, PluginError

__all__ = ["Allocation", "Device", "DeviceListTooLarge", "DevicePlugin", "DeviceSpec", "Mount", "PluginError"]
