//! The workloads the end-to-end suite and the benchmarks apply: a namespace
//! and a Deployment of the app image, one container running a shell line.

use serde_json::json;

/// The ambient label of a namespace.
pub const AMBIENT: (&str, &str) = ("istio.io/dataplane-mode", "ambient");

/// busybox httpd on `port`, answering its pod's name.
pub fn httpd(port: u16) -> String {
    format!(
        "mkdir -p /tmp/www && hostname > /tmp/www/index.html && exec httpd -f -p {port} -h /tmp/www"
    )
}

/// A namespace and a Deployment of the app image.
pub struct AppDeployment<'a> {
    pub namespace: &'a str,
    /// The namespace's labels (e.g. [`AMBIENT`]).
    pub labels: &'a [(&'a str, &'a str)],
    /// The Deployment's name and its pods' `app` label.
    pub app: &'a str,
    pub replicas: usize,
    /// The container's name.
    pub container: &'a str,
    /// What the container runs, with `/bin/sh -c`.
    pub shell: &'a str,
    /// Fields added to the container (probes), as YAML flow mappings by
    /// field name.
    pub container_fields: &'a [(&'a str, serde_json::Value)],
    /// Service environment variables in the pods (kubelet's default: on).
    pub service_links: bool,
}

impl AppDeployment<'_> {
    /// The two objects, as one YAML stream (JSON is YAML: every value is
    /// quoted as JSON, so no shell line or label needs escaping by hand).
    pub fn yaml(&self) -> String {
        let labels: serde_json::Map<String, serde_json::Value> = self
            .labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let mut container = json!({
            "name": self.container,
            "image": crate::kube::images::APP,
            "imagePullPolicy": "Never",
            "command": ["/bin/sh", "-c", self.shell],
        });
        for (field, value) in self.container_fields {
            container[*field] = value.clone();
        }
        let mut pod = json!({
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
        });
        if !self.service_links {
            pod["enableServiceLinks"] = json!(false);
        }
        let namespace = json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": self.namespace, "labels": labels},
        });
        let deployment = json!({
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": self.app, "namespace": self.namespace},
            "spec": {
                "replicas": self.replicas,
                "selector": {"matchLabels": {"app": self.app}},
                "template": {
                    "metadata": {"labels": {"app": self.app}},
                    "spec": pod,
                },
            },
        });
        format!("{namespace}\n---\n{deployment}\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workload_is_what_it_is_asked_to_be() {
        let yaml = AppDeployment {
            namespace: "ns",
            labels: &[("ambpf-bench", "true"), AMBIENT],
            app: "web",
            replicas: 3,
            container: "server",
            shell: &httpd(8080),
            container_fields: &[("readinessProbe", json!({"exec": {"command": ["true"]}}))],
            service_links: false,
        }
        .yaml();
        let objects: Vec<serde_json::Value> = yaml
            .split("\n---\n")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let [namespace, deployment] = &objects[..] else {
            panic!("{yaml}")
        };
        assert_eq!(namespace["metadata"]["labels"][AMBIENT.0], AMBIENT.1);
        assert_eq!(namespace["metadata"]["labels"]["ambpf-bench"], "true");
        assert_eq!(deployment["spec"]["replicas"], 3);
        let pod = &deployment["spec"]["template"]["spec"];
        assert_eq!(pod["enableServiceLinks"], false);
        let container = &pod["containers"][0];
        assert_eq!(container["name"], "server");
        assert_eq!(container["command"][2], httpd(8080));
        assert_eq!(container["readinessProbe"]["exec"]["command"][0], "true");
        assert_eq!(
            deployment["spec"]["selector"]["matchLabels"]["app"],
            deployment["spec"]["template"]["metadata"]["labels"]["app"]
        );
    }
}
