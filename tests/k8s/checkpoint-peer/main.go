// Command checkpoint-peer drives the kubelet's device-manager checkpoint code
// (k8s.io/kubernetes/pkg/kubelet/checkpointmanager and
// pkg/kubelet/cm/devicemanager/checkpoint) over stdin/stdout, one JSON line
// each way. tests/integration/test_checkpoint_store.py uses it as the peer that
// reads what deviceplane writes and writes what deviceplane reads.
//
//	request:  {"Op": "read"|"decode"|"write", "Dir": dir, "Blob": base64}
//	response: {"error": "...", "spew": dump.ForHash(data), "file": base64 of MarshalCheckpoint}
package main

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"os"

	"k8s.io/kubernetes/pkg/kubelet/checkpointmanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/checkpoint"
	"k8s.io/utils/dump"
)

const name = "kubelet_internal_checkpoint"

type request struct{ Op, Dir, Blob string }

type response struct {
	Error string `json:"error"`
	Spew  string `json:"spew"`
	File  string `json:"file"`
}

func main() {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var req request
		if err := json.Unmarshal(in.Bytes(), &req); err != nil {
			panic(err)
		}
		blob, _ := base64.StdEncoding.DecodeString(req.Blob)
		// What ManagerImpl.getCheckpoint decodes into.
		cp := checkpoint.New(make([]checkpoint.PodDevicesEntry, 0), make(map[string][]string)).(*checkpoint.Data)
		var err error
		unmarshaled := false
		switch req.Op {
		case "read": // ManagerImpl.readCheckpoint's path
			var m checkpointmanager.CheckpointManager
			if m, err = checkpointmanager.NewCheckpointManager(req.Dir); err == nil {
				err = m.GetCheckpoint(name, cp)
			}
		case "decode":
			if err = cp.UnmarshalCheckpoint(blob); err == nil {
				unmarshaled = true
				err = cp.VerifyChecksum()
			}
		case "write": // ManagerImpl.writeCheckpoint's path, for the data in blob
			if err = cp.UnmarshalCheckpoint(blob); err == nil {
				var m checkpointmanager.CheckpointManager
				if m, err = checkpointmanager.NewCheckpointManager(req.Dir); err == nil {
					entries, registered := cp.GetData()
					err = m.CreateCheckpoint(name, checkpoint.New(entries, registered))
				}
			}
		}
		var resp response
		if err != nil {
			resp.Error = err.Error()
		}
		if err == nil || unmarshaled { // the values decoded, even when their checksum does not match
			resp.Spew = dump.ForHash(cp.Data)
			entries, registered := cp.GetData()
			file, err := checkpoint.New(entries, registered).MarshalCheckpoint()
			if err != nil {
				panic(err)
			}
			resp.File = base64.StdEncoding.EncodeToString(file)
		}
		if err := out.Encode(resp); err != nil {
			panic(err)
		}
	}
}
