//! Service names: a pod resolves its namespace's `web` Service by name
//! through the cluster's DNS (CoreDNS behind `kube-dns`) and connects to it
//! by name. In the ambient namespace ambpf captures the query into the
//! ztunnel double's DNS proxy, which forwards it to the cluster's DNS as
//! ztunnel does, and the connection into its outbound listener; in the plain
//! twin the same lookup and connection work and leave no trace in the
//! double's log.

use std::{net::IpAddr, time::Duration};

use anyhow::{Context as _, Result, ensure};
use serde_json::Value;

use super::client::{Cluster, Release};
use super::{eventually, scenarios};
use crate::kube::coredns::nslookup_addresses;

/// The `web` Service's port ([`scenarios::ensure_web`]).
const WEB_SERVICE_PORT: u16 = 80;
/// How long the double's log may lag behind what it answered.
const LOG_PATIENCE: Duration = Duration::from_secs(15);

/// What one namespace's client saw.
struct Lookup {
    namespace: String,
    /// The client pod: `(name, uid)`.
    client: (String, String),
    service_name: String,
    cluster_ip: IpAddr,
}

pub(super) fn service_name(cluster: &Cluster, release: &Release) -> Result<String> {
    let (ambient, plain) = scenarios::setup(cluster, release)?;
    let captured = resolve_and_connect(cluster, &ambient)?;
    let uncaptured = resolve_and_connect(cluster, &plain)?;

    let (query, connection) = eventually(
        "the ambient pod's query and connection in the double's log",
        LOG_PATIENCE,
        || {
            let events = cluster.ztunnel_events()?;
            let query = dns_queries(&events, &captured.service_name)
                .find(|e| e["uid"] == captured.client.1.as_str())
                .cloned();
            let connection = connections_to(&events, captured.cluster_ip)
                .find(|e| e["uid"] == captured.client.1.as_str() && e["listener_port"] == 15001)
                .cloned();
            Ok(query.zip(connection))
        },
    )?;
    ensure!(
        query["answer"] == captured.cluster_ip.to_string(),
        "the double relayed {} for {}, not the ClusterIP {}",
        query["answer"],
        captured.service_name,
        captured.cluster_ip
    );

    // The plain pod's lookup and connection were done once the ambient
    // pod's show in the log, which is written in order.
    let events = cluster.ztunnel_events()?;
    let leaked: Vec<&Value> = dns_queries(&events, &uncaptured.service_name)
        .chain(connections_to(&events, uncaptured.cluster_ip))
        .collect();
    ensure!(
        leaked.is_empty(),
        "the plain pod {}/{} was captured: {leaked:?}",
        uncaptured.namespace,
        uncaptured.client.0
    );
    Ok(format!(
        "{} resolved to {} through the double's DNS proxy (query {} over {}), connection by \
         name proxied (original destination {}); plain twin resolved and connected uncaptured",
        captured.service_name,
        captured.cluster_ip,
        query["name"],
        query["transport"],
        connection["original_dst"]
    ))
}

/// From one of `namespace`'s `web` pods: `nslookup` of the `web` Service's
/// name, which must give its ClusterIP, then an HTTP GET by that name.
fn resolve_and_connect(cluster: &Cluster, namespace: &str) -> Result<Lookup> {
    let service = cluster.get_json(&["service", "-n", namespace, "web"])?;
    let cluster_ip: IpAddr = service["spec"]["clusterIP"]
        .as_str()
        .unwrap_or_default()
        .parse()
        .with_context(|| format!("{namespace}/web has no ClusterIP"))?;
    let (name, uid, _) = cluster
        .pods(namespace, "web")?
        .into_iter()
        .next()
        .with_context(|| format!("no web pod in {namespace}"))?;
    let service_name = format!("web.{namespace}.svc.cluster.local");
    let exec = |command: &[&str]| {
        let mut args = vec!["exec", "-n", namespace, &name, "--"];
        args.extend(command);
        cluster.kubectl(&args)
    };
    let answer = exec(&["nslookup", "-type=a", &service_name])
        .with_context(|| format!("{namespace}/{name} resolving {service_name}"))?;
    let addresses = nslookup_addresses(&answer);
    ensure!(
        addresses == [cluster_ip],
        "{service_name} resolved to {addresses:?} in {namespace}/{name}, not its ClusterIP \
         {cluster_ip}:\n{answer}"
    );
    // busybox's `wget -T` crashes on a refused connection: `timeout`.
    let page = exec(&[
        "timeout",
        "10",
        "wget",
        "-qO-",
        &format!("http://{service_name}/"),
    ])
    .with_context(|| format!("{namespace}/{name} connecting to {service_name}"))?;
    // Each web pod serves its own name.
    ensure!(
        page.trim().starts_with("web-"),
        "{service_name} answered {page:?} in {namespace}/{name}"
    );
    Ok(Lookup {
        namespace: namespace.to_owned(),
        client: (name, uid),
        service_name,
        cluster_ip,
    })
}

/// The double's `dns_query` events for `name`, from any pod.
fn dns_queries<'e>(events: &'e [Value], name: &'e str) -> impl Iterator<Item = &'e Value> {
    events
        .iter()
        .filter(move |e| e["event"] == "dns_query" && e["name"] == name)
}

/// The double's proxied connections to `ip` on the `web` Service's port,
/// from any pod.
fn connections_to(events: &[Value], ip: IpAddr) -> impl Iterator<Item = &Value> {
    let destination = std::net::SocketAddr::new(ip, WEB_SERVICE_PORT).to_string();
    events
        .iter()
        .filter(move |e| e["event"] == "connection" && e["original_dst"] == destination.as_str())
}
